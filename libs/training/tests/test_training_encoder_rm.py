"""The ``reward_hh_minilm`` recipe: a reward model from the bundled all-MiniLM-L6-v2 encoder.

A tiny run (a few HH-RLHF pairs, two steps, 48 tokens) trains ``BertForSequenceClassification``
from the encoder, reports held-out pairwise accuracy with its Wilson interval on pairs it never
trained on, writes those pairs to a file, and exports a folder that ``forge rm eval`` (the
preference-feedback service's scorer) encodes token for token as training did and scores to the
same accuracy. Sequences are cut from the left, so the final response survives.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from forge_training import recipes, validation
from forge_training.backbones import minilm_dir
from forge_training.pairs import (
    PreferencePair,
    encode_pairs_for_encoder,
    load_pairs,
    opening,
    render,
    split_extra,
    to_pair,
    transcript,
)
from forge_training.rm import eval as rm_eval
from forge_training.run import EXIT_BAD_RECIPE, main
from forge_training.schema import PairsConfig, RecipeError


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))


def _pair(*turns: str) -> PreferencePair:
    """A pair from alternating user/assistant turns, the last two being chosen and rejected."""
    *prompt, chosen, rejected = turns
    roles = ["user", "assistant"]
    return PreferencePair(tuple((roles[i % 2], t) for i, t in enumerate(prompt)), chosen, rejected)


def test_long_conversations_are_cut_from_the_left_so_the_final_response_survives(
    tokenizer: Tokenizer,
) -> None:
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    assert cls_id is not None and sep_id is not None
    early = " ".join(["weather"] * 60)
    pair = _pair(f"tell me about {early}", "it rains", "what is a good dog", "a beagle is friendly", "no")
    ((chosen, rejected),) = encode_pairs_for_encoder(tokenizer, [pair], 24, cls_id, sep_id)
    for row, response in ((chosen, "a beagle is friendly"), (rejected, "no")):
        ids = list(row.ids)
        assert len(ids) == 24 and ids[0] == cls_id and ids[-1] == sep_id
        assert tokenizer.decode(ids[row.prompt_len : -1]) == response  # the whole response is kept
        assert tokenizer.decode(ids[1 : row.prompt_len]).endswith("user : what is a good dog assistant :")
        assert "tell me" not in tokenizer.decode(ids)  # the oldest turn went first
    # A response longer than the window keeps its end, not its start.
    words = [f"w{i}" for i in range(40)]
    ((long_chosen, _),) = encode_pairs_for_encoder(
        tokenizer, [_pair("question", " ".join(words), "no")], 16, cls_id, sep_id
    )
    assert long_chosen.prompt_len == 1 and tokenizer.decode(list(long_chosen.ids[1:-1])).endswith("w39")
    assert "w0 " not in tokenizer.decode(list(long_chosen.ids))
    # Short ones are not padded or cut: the source tokenizer.json's own 128-token setting is off.
    ((short, _),) = encode_pairs_for_encoder(
        tokenizer, [_pair("hi", "hello", "go away")], 256, cls_id, sep_id
    )
    assert tokenizer.decode(list(short.ids)) == "user : hi assistant : hello"


def test_held_out_pairs_are_never_trained_on_not_even_their_openings(tmp_path: Path) -> None:
    rows = [(f"topic {i % 12} question {i}", f"good {i}", f"bad {i}") for i in range(60)]
    main_file = tmp_path / "helpful.jsonl"
    main_file.write_text(
        "".join(json.dumps({"chosen": transcript(p, p.chosen), "rejected": transcript(p, p.rejected)}) + "\n"
                for p in (_pair(f"topic {i % 12}", "sure", q, c, r) for i, (q, c, r) in enumerate(rows)))
    )  # fmt: skip
    extra = tmp_path / "harmless.jsonl.gz"
    with gzip.open(extra, "wt") as handle:
        for i in range(20):  # openings "topic 0" .. "topic 19": 12 shared with the main file
            p = _pair(f"topic {i}", "sure", "another question", f"yes {i}", f"no {i}")
            handle.write(
                json.dumps({"chosen": transcript(p, p.chosen), "rejected": transcript(p, p.rejected)}) + "\n"
            )
    plain = PairsConfig(path=str(main_file))
    train, val = load_pairs(plain, seed=5, val_fraction=0.25)
    assert len(val) == 15 and not set(train) & set(val)
    assert {opening(p) for p in train} & {opening(p) for p in val}  # the plain split shares openings
    guarded = PairsConfig(path=str(main_file), extra_train=str(extra), exclude_shared_openings=True)
    g_train, g_val = load_pairs(guarded, seed=5, val_fraction=0.25)
    assert g_val == val  # the held-out set does not change
    held_openings = {opening(p) for p in g_val}
    assert not {opening(p) for p in g_train} & held_openings and not set(g_train) & set(g_val)
    from_extra = [p for p in g_train if p.prompt[-1][1] == "another question"]
    assert len(from_extra) == 20 - len(held_openings)  # extra pairs train, unless they open like held-out
    assert all(to_pair(json.loads(line)) is not None for line in main_file.read_text().splitlines())


def test_a_held_out_share_of_the_extra_pairs_is_never_trained_on(tmp_path: Path) -> None:
    main_file, extra = tmp_path / "helpful.jsonl", tmp_path / "harmless.jsonl"
    for path, tag, n in ((main_file, "help", 40), (extra, "harm", 50)):
        pairs = [_pair(f"{tag} opening {i % 25}", "sure", f"q {i}", f"yes {i}", f"no {i}") for i in range(n)]
        path.write_text(
            "".join(json.dumps({"chosen": transcript(p, p.chosen), "rejected": transcript(p, p.rejected)}) + "\n"
                    for p in pairs)
        )  # fmt: skip
    all_extra = PairsConfig(path=str(main_file), extra_train=str(extra), exclude_shared_openings=True)
    split = PairsConfig(
        path=str(main_file), extra_train=str(extra), exclude_shared_openings=True, extra_val_fraction=0.4
    )
    trainable, held = split_extra(split, seed=3)
    assert len(held) == 20 and len(trainable) == 30 and not set(trainable) & set(held)
    assert split_extra(split, seed=3) == (trainable, held)  # seeded
    assert split_extra(all_extra, seed=3) == (split_extra(all_extra, seed=3)[0], [])
    train, val = load_pairs(split, seed=3, val_fraction=0.25)
    assert val == load_pairs(all_extra, seed=3, val_fraction=0.25)[1]  # the main held-out set stays
    held_openings = {opening(p) for p in [*val, *held]}
    assert not set(train) & set(held) and not {opening(p) for p in train} & held_openings
    assert any(p.prompt[0][1].startswith("harm") for p in train)  # the rest of the extra pairs train
    assert len(train) < len(load_pairs(all_extra, seed=3, val_fraction=0.25)[0])
    with pytest.raises(RecipeError, match=r"pairs\.extra_val_fraction: needs pairs\.extra_train"):
        validation.validate(recipes.build("reward_hh_minilm", {"pairs.extra_val_fraction": "0.5"}), 1)
    bad = {"pairs.extra_train": str(extra), "pairs.extra_val_fraction": "1.0"}
    with pytest.raises(RecipeError, match=r"pairs\.extra_val_fraction: must be in \[0, 1\)"):
        validation.validate(recipes.build("reward_hh_minilm", bad), 1)


def test_a_bundled_backbone_is_refused_where_it_cannot_run() -> None:
    config = recipes.build("reward_hh_minilm")
    assert config.task == "reward" and config.init.backbone == "minilm"
    validation.validate(config, 1)  # no parent needed
    with pytest.raises(RecipeError, match=r"init\.parent: the 'minilm' backbone brings its own weights"):
        validation.validate(recipes.build("reward_hh_minilm", {"init.parent": "/tmp/x"}), 1)
    with pytest.raises(RecipeError, match=r"init\.backbone: only the reward and rerank tasks"):
        validation.validate(recipes.build("sft_hh", {"init.backbone": "minilm"}), 1)
    with pytest.raises(RecipeError, match=r"init\.backbone: must be one of parent, minilm"):
        validation.validate(recipes.build("reward_hh_minilm", {"init.backbone": "bert-huge"}), 1)
    with pytest.raises(RecipeError, match=r"pairs\.extra_train: '/nonexistent' does not exist"):
        validation.validate(recipes.build("reward_hh_minilm", {"pairs.extra_train": "/nonexistent"}), 1)
    with pytest.raises(RecipeError, match=r"model\.hidden_size: not used by the 'reward' task"):
        recipes.build("reward_hh_minilm", {"model.hidden_size": "64"})


TINY = {
    "pairs.max_pairs": "30",
    "data.val_fraction": "0.4",  # 12 held out, at most 18 trained on
    "data.seq_len": "48",
    "global_batch_size": "4",
    "micro_batch_size": "2",
    "max_steps": "2",
    "eval_interval": "2",
    "eval_batches": "6",  # 6 x 2 = every held-out pair
    "optim.lr": "1e-3",
    "optim.min_lr": "1e-4",
    "optim.warmup_steps": "0",
    "log_interval": "1",
    "checkpoint.interval_steps": "0",
    "threads": "1",
}


def test_minilm_reward_model_trains_reports_held_out_accuracy_and_forge_rm_eval_agrees(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    args = [
        "--recipe",
        "reward_hh_minilm",
        "--run-dir",
        str(run_dir),
        "--run-id",
        "rm",
        "--cache-dir",
        str(cache),
    ]
    for key, value in TINY.items():
        args += ["--set", f"{key}={value}"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ev = summary["eval"]
    assert summary["outcome"] == "succeeded" and summary["step"] == 2
    assert ev["eval_pairs"] == 12 and 0.0 <= ev["pairwise_accuracy_low"] <= ev["pairwise_accuracy"]
    assert ev["pairwise_accuracy"] <= ev["pairwise_accuracy_high"] <= 1.0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["step"] == 0 and "pairwise_accuracy" in metrics[0]  # the untrained baseline
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2]
    manifest = json.loads((run_dir / "objects/checkpoints/rm/step-00000002/manifest.json").read_text())
    assert manifest["meta"]["task"] == "reward" and "all-MiniLM-L6-v2" in manifest["meta"]["backbone"]
    assert manifest["meta"]["model_config"]["model_type"] == "bert"
    # The held-out pairs file is exactly the held-out split, and nothing in it was trained on.
    config = recipes.build("reward_hh_minilm", TINY)
    train, held_out = load_pairs(config.pairs, config.seed, config.data.val_fraction)
    held_file = cache / "held_out_pairs.jsonl"
    written = [to_pair(json.loads(line)) for line in held_file.read_text().splitlines()]
    assert written == held_out and not {opening(p) for p in train} & {opening(p) for p in held_out}
    trained = [to_pair(json.loads(line)) for line in (cache / "train_pairs.jsonl").read_text().splitlines()]
    assert trained == train  # the file a length correction is fitted on (rm_residual)
    # forge rm eval on the export: BERT-aware (wraps [CLS] ... [SEP], cuts from the left, 48
    # tokens, the exported template), the same ids as training, the same held-out accuracy.
    export = Path(summary["export_dir"])
    model = rm_eval.RewardModel(export)
    assert model.max_length == 48 and model.wrap is not None
    tok = Tokenizer.from_file(str(export / "tokenizer.json"))
    scorable = list(rm_eval.read_pairs(held_file, Counter()))
    ours = encode_pairs_for_encoder(tok, held_out, 48, *model.wrap)
    assert [model.encode(p) for p in scorable] == [(list(c.ids), list(r.ids)) for c, r in ours]
    messages = held_out[0].messages()
    assert model.render_prompt(tuple((m["role"], m["content"]) for m in messages)) == render(
        messages, add_generation_prompt=True, eos=""
    )
    scores = rm_eval.evaluate(model, iter(scorable), batch_size=2)
    result: dict[str, Any] = scores.summary()
    assert result["n"] == 12 and result["accuracy"] == pytest.approx(ev["pairwise_accuracy"])


def test_the_recipe_refuses_a_bad_backbone_before_starting(tmp_path: Path) -> None:
    args = ["--recipe", "reward_hh_minilm", "--run-dir", str(tmp_path), "--set", "init.backbone=gpt"]
    assert main(args) == EXIT_BAD_RECIPE
