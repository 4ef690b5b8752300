"""Training tasks end to end on tiny models: continual pre-training, SFT, reward model and DPO
start from a parent checkpoint (Hugging Face directory or Forge manifest), train a few steps,
report their metrics, resume exactly with loader prefetch, and train the same under 2-process
DDP; the Young/Daly interval and the MFU estimate show up in a run's metrics."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from forge_kit.objectstore import ObjectStore
from forge_kit.paths import resolve_data_path
from forge_training import recipes, schema, validation
from forge_training.checkpoint import Manifest, optimal_interval_s
from forge_training.launch import run_group_sequence
from forge_training.mfu import train_flops_per_token
from forge_training.pairs import encode_pairs, load_pairs
from forge_training.run import EXIT_BAD_RECIPE, main
from forge_training.schema import RecipeError, TrainConfig
from forge_training.train import RunContext, TrainResult, train

SHAKESPEARE = resolve_data_path(schema.DEFAULT_CORPUS)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """40 kB of Shakespeare (the parent's corpus, and the general data) and 80 SciFact abstracts."""
    root = tmp_path_factory.mktemp("corpora")
    general = root / "shakespeare.txt"
    general.write_text(SHAKESPEARE.read_text(encoding="utf-8")[:40_000], encoding="utf-8")
    domain = root / "scifact.jsonl"
    with open(resolve_data_path(schema.SCIFACT_CORPUS), encoding="utf-8") as handle:
        domain.write_text("".join(next(handle) for _ in range(80)), encoding="utf-8")
    return {"general": general, "domain": domain}


@pytest.fixture(scope="module")
def parent(corpora: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 3-step pre-trained smoke model: its HF export and its Forge manifest."""
    root = tmp_path_factory.mktemp("parent")
    config = recipes.build(
        "smoke", {"data.corpus": str(corpora["general"]), "max_steps": "3", "threads": "1"}
    )
    result = train(config, _ctx(root, "parent"))
    assert result.export_dir is not None
    manifest = root / "objects" / "checkpoints" / "parent" / "step-00000003" / "manifest.json"
    assert manifest.is_file()
    return {"hf": result.export_dir, "manifest": manifest, "cache": root / "cache"}


def _ctx(root: Path, run_id: str = "run", **kw: Any) -> RunContext:
    return RunContext(
        run_id=run_id,
        run_dir=root / "run",
        store=ObjectStore(str(root / "objects")),
        cache_dir=root / "cache",
        **kw,
    )


def _metrics(root: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]


SMALL = {
    "global_batch_size": "4",
    "micro_batch_size": "2",
    "log_interval": "1",
    "threads": "1",
    "optim.warmup_steps": "1",
    "checkpoint.interval_steps": "2",
}


def cpt_config(corpora: dict[str, Path], parent: Path, **extra: str) -> TrainConfig:
    overrides = {
        **SMALL,
        "init.parent": str(parent),
        "data.corpus": str(corpora["domain"]),
        "data.seq_len": "32",
        "mixture.general_corpus": str(corpora["general"]),
        "mixture.general_fraction": "0.2",
        "optim.lr": "3e-3",
        "optim.min_lr": "3e-4",
        "max_steps": "6",
        "eval_interval": "3",
        "eval_batches": "2",
        **extra,
    }
    return recipes.build("cpt_scifact", overrides)


def pair_config(recipe: str, parent: Path, **extra: str) -> TrainConfig:
    overrides = {
        **SMALL,
        "init.parent": str(parent),
        "pairs.max_pairs": "40",
        "data.seq_len": "48",
        "optim.lr": "1e-2",
        "optim.min_lr": "1e-3",
        "max_steps": "4",
        "eval_interval": "4",
        "eval_batches": "3",
        **extra,
    }
    return recipes.build(recipe, overrides)


# -- continual pre-training ---------------------------------------------------------------------


def test_continual_pretraining_from_a_manifest_logs_forgetting_and_resumes_exactly_with_prefetch(
    corpora: dict[str, Path], parent: dict[str, Path], tmp_path: Path
) -> None:
    config = cpt_config(corpora, parent["manifest"], **{"data.prefetch_batches": "3"})
    full = train(config, _ctx(tmp_path / "full"))
    assert full.outcome == "succeeded" and full.losses[6] < full.losses[1]
    lines = _metrics(tmp_path / "full")
    assert lines[0]["step"] == 0 and {"val_loss", "general_val_loss"} <= set(lines[0])  # the parent
    final = [ln for ln in lines if "forgetting" in ln][-1]
    assert {"val_loss", "val_ppl", "general_val_loss", "general_val_ppl"} <= set(final)
    assert final["forgetting"] == pytest.approx(final["general_val_loss"] - lines[0]["general_val_loss"])
    fractions = [ln["general_fraction"] for ln in lines if "general_fraction" in ln]
    assert len(fractions) == 6 and 0.0 <= sum(fractions) / 6 <= 0.6  # 24 sequences at 20 %
    # Killed after step 3 (checkpoint at 2, prefetch 3 steps ahead) and resumed: the same curve.
    killed = train(config, _ctx(tmp_path / "resumed", stop_after_step=3))
    assert killed.outcome == "stopped"
    # Another run started from the killed one's newest checkpoint (a sweep trial promoted after a
    # pause): the same curve from there on, its checkpoints under its own id, the source untouched.
    store = ObjectStore(str(tmp_path / "resumed" / "objects"))
    before = sorted(store.list("checkpoints/run"))
    promoted = train(
        config,
        RunContext(
            run_id="promoted",
            run_dir=tmp_path / "promoted" / "run",
            store=store,
            cache_dir=tmp_path / "promoted" / "cache",
            resume_from="run",
        ),
    )
    assert sorted(promoted.losses) == [3, 4, 5, 6]
    assert all(loss == full.losses[step] for step, loss in promoted.losses.items())
    assert sorted(store.list("checkpoints/run")) == before
    assert any("/step-00000006/" in key for key in store.list("checkpoints/promoted"))
    resumed = train(config, _ctx(tmp_path / "resumed"))
    assert sorted(resumed.losses) == [3, 4, 5, 6]
    for step, loss in resumed.losses.items():
        assert loss == full.losses[step], step
    # Read-ahead does not change what is read: no prefetch gives the identical curve.
    plain = train(
        dataclasses.replace(config, data=dataclasses.replace(config.data, prefetch_batches=0)),
        _ctx(tmp_path / "plain", export=False),
    )
    assert plain.losses == full.losses


# -- SFT ----------------------------------------------------------------------------------------


def test_sft_from_a_hugging_face_parent_lowers_the_response_loss_and_exports_a_chat_model(
    parent: dict[str, Path], tmp_path: Path
) -> None:
    config = pair_config(
        "sft_hh", parent["hf"], **{"pairs.max_pairs": "16", "max_steps": "8", "eval_interval": "8"}
    )
    result = train(config, _ctx(tmp_path))
    assert result.outcome == "succeeded"
    first, last = (result.losses[1] + result.losses[2]) / 2, (result.losses[7] + result.losses[8]) / 2
    assert last < first
    assert "val_loss" in result.eval_metrics and math.isfinite(result.eval_metrics["val_loss"])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert result.export_dir is not None
    tok = AutoTokenizer.from_pretrained(result.export_dir)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "User: Hi\nAssistant:"
    model = AutoModelForCausalLM.from_pretrained(result.export_dir)
    assert model.config.max_position_embeddings >= 48


# -- reward model -------------------------------------------------------------------------------


def test_reward_model_reports_held_out_pairwise_accuracy_that_the_export_reproduces(
    parent: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    args = [
        "--recipe",
        "reward_hh",
        "--run-dir",
        str(run_dir),
        "--run-id",
        "rm",
        "--cache-dir",
        str(tmp_path / "c"),
    ]
    config = pair_config("reward_hh", parent["hf"], **{"pairs.max_pairs": "80"})
    for key, value in {**SMALL, "init.parent": str(parent["hf"]), "pairs.max_pairs": "80", "data.seq_len": "48",
                       "optim.lr": "1e-2", "optim.min_lr": "1e-3", "max_steps": "4", "eval_interval": "4",
                       "eval_batches": "3"}.items():  # fmt: skip
        args += ["--set", f"{key}={value}"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["outcome"] == "succeeded"
    ev = summary["eval"]
    assert ev["eval_pairs"] == 6  # all 8 held-out pairs would need eval_batches 4: 3 x 2 evenly spread
    assert ev["pairwise_accuracy_low"] <= ev["pairwise_accuracy"] <= ev["pairwise_accuracy_high"]
    logged = [ln for ln in _metrics(tmp_path) if "pairwise_accuracy" in ln]
    assert logged and logged[-1]["pairwise_accuracy"] == ev["pairwise_accuracy"]
    manifest = json.loads(
        (run_dir / "objects" / "checkpoints" / "rm" / "step-00000004" / "manifest.json").read_text()
    )
    assert manifest["meta"]["metrics"]["pairwise_accuracy"] == ev["pairwise_accuracy"]
    assert manifest["meta"]["task"] == "reward"
    # The exported reward model, loaded by plain transformers, scores the same held-out pairs the
    # same way: the reported accuracy is a held-out figure, not a training one.
    from tokenizers import Tokenizer
    from transformers import AutoModelForSequenceClassification

    rm = AutoModelForSequenceClassification.from_pretrained(summary["export_dir"]).eval()
    tok = Tokenizer.from_file(str(Path(summary["export_dir"]) / "tokenizer.json"))
    train_pairs, held_out = load_pairs(config.pairs, config.seed, config.data.val_fraction)
    assert len(held_out) == 8 and not set(held_out) & set(train_pairs)
    picked = [held_out[i] for i in (0, 1, 3, 4, 6, 7)]  # np.linspace(0, 7, 6) as integers
    correct = 0
    with torch.no_grad():
        for chosen, rejected in encode_pairs(tok, picked, 48, end_of_text=False):
            scores = [float(rm(input_ids=torch.tensor([list(r.ids)])).logits) for r in (chosen, rejected)]
            correct += scores[0] > scores[1]
    assert correct / 6 == pytest.approx(ev["pairwise_accuracy"])


# -- DPO ----------------------------------------------------------------------------------------


def test_dpo_starts_at_log_2_against_the_frozen_parent_and_logs_reward_margins(
    parent: dict[str, Path], tmp_path: Path
) -> None:
    config = pair_config("dpo_hh", parent["manifest"], **{"max_steps": "3", "eval_interval": "3"})
    result = train(config, _ctx(tmp_path))
    assert result.losses[1] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference at step 0
    start = _metrics(tmp_path)[0]
    assert start["step"] == 0 and start["val_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert start["val_reward_accuracy"] == 0.5  # every held-out pair ties: one half each
    lines = [ln for ln in _metrics(tmp_path) if "reward_margin" in ln]
    assert lines[0]["logratio_chosen"] == 0.0 and lines[0]["reward_margin"] == 0.0
    assert lines[0]["reward_accuracy"] == 0.5
    assert lines[-1]["reward_margin"] != 0.0  # the policy has moved away from the reference
    assert {"reward_chosen", "reward_rejected", "reward_accuracy", "logratio_rejected"} <= set(lines[-1])
    assert {"val_loss", "val_reward_accuracy", "val_reward_margin"} <= set(result.eval_metrics)


# -- DDP and FSDP -------------------------------------------------------------------------------


def test_two_gloo_processes_train_every_task_like_one(
    corpora: dict[str, Path], parent: dict[str, Path], tmp_path: Path
) -> None:
    """One 2-process group runs the four tasks in turn (one start-up), under DDP and under FSDP;
    each matches a single-process run with the same global batch, step by step and on the
    held-out metric (DPO's frozen reference model stays whole on every rank under FSDP)."""
    few = {"max_steps": "2", "eval_interval": "2", "checkpoint.interval_steps": "0"}
    configs = {
        (task, parallelism): config
        for parallelism in ("ddp", "fsdp")
        for task, config in {
            "cpt": cpt_config(corpora, parent["hf"], parallelism=parallelism, **few),
            **{
                task: pair_config(f"{task}_hh", parent["hf"], parallelism=parallelism, **few)
                for task in ("sft", "reward", "dpo")
            },
        }.items()
    }
    cache = tmp_path / "cache"
    doubles = run_group_sequence(
        [(c, tmp_path / "two" / "-".join(key)) for key, c in configs.items()], 2, cache_dir=cache
    )
    singles: dict[str, TrainResult] = {}
    for ((task, parallelism), config), double in zip(configs.items(), doubles, strict=True):
        if task not in singles:  # one process trains the plain model under either setting
            ctx = RunContext(run_id=task, run_dir=tmp_path / "one" / task, store=ObjectStore(str(tmp_path / "o1")),
                             cache_dir=cache, export=False)  # fmt: skip
            singles[task] = train(config, ctx)
        single = singles[task]
        for step in (1, 2):
            assert double["losses"][step] == pytest.approx(single.losses[step], rel=1e-4), (
                task,
                parallelism,
                step,
            )
        assert double["eval_metrics"]["val_loss"] == pytest.approx(
            single.eval_metrics["val_loss"], rel=1e-4
        ), (task, parallelism)


# -- checkpoint interval and MFU ----------------------------------------------------------------


def test_young_interval_is_planned_from_the_first_measured_save(
    corpora: dict[str, Path], tmp_path: Path
) -> None:
    config = recipes.build(
        "smoke",
        {"data.corpus": str(corpora["general"]), "max_steps": "14", "threads": "1", "eval_interval": "100",
         "checkpoint.interval_policy": "young", "checkpoint.mtbf_s": "2.0", "checkpoint.interval_steps": "2",
         "checkpoint.keep_last": "20"},
    )  # fmt: skip
    published: list[Manifest] = []
    result = train(config, _ctx(tmp_path, on_published=published.append, export=False))
    (plan,) = [ln for ln in _metrics(tmp_path) if "checkpoint_interval_steps" in ln]
    assert plan["step"] == 2 and plan["checkpoint_policy"] == "young"
    interval_s = optimal_interval_s("young", plan["checkpoint_save_s"], 2.0)
    assert plan["checkpoint_interval_s"] == pytest.approx(interval_s)
    k = plan["checkpoint_interval_steps"]
    assert k == max(1, round(interval_s / plan["step_s"])) and result.checkpoint_interval_steps == k
    expected = [2, *range(2 + k, 14, k), 14]
    assert [m.step for m in published] == sorted(set(expected))


def test_mfu_is_model_flops_per_second_over_the_configured_peak(
    corpora: dict[str, Path], tmp_path: Path
) -> None:
    config = recipes.build(
        "smoke",
        {
            "data.corpus": str(corpora["general"]),
            "max_steps": "3",
            "threads": "1",
            "metrics.peak_flops": "1e9",
        },
    )
    result = train(config, _ctx(tmp_path, export=False))
    from transformers import LlamaConfig

    m, vocab = config.model, config.data.vocab_size
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                      num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
                      num_key_value_heads=m.num_kv_heads)  # fmt: skip
    per_token = train_flops_per_token(cfg, vocab, config.data.seq_len)
    for line in (ln for ln in _metrics(tmp_path) if "mfu" in ln):
        assert line["mfu"] == pytest.approx(line["tokens_per_s"] * per_token / 1e9, rel=1e-9)
    assert result.mfu is not None and result.mfu > 0


# -- bad input ----------------------------------------------------------------------------------


def test_a_corrupt_manifest_parent_and_a_missing_one_are_refused_before_anything_starts(
    parent: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    objects = parent["manifest"].parents[3]
    copy = tmp_path / "objects"
    shutil.copytree(objects, copy)
    manifest = copy / "checkpoints" / "parent" / "step-00000003" / "manifest.json"
    shard = manifest.parent / "rank-00000.pt"
    shard.write_bytes(shard.read_bytes()[:-10] + b"0123456789")
    config = recipes.build("dpo_hh", {"init.parent": str(manifest)})
    with pytest.raises(RecipeError, match=r"init\.parent: .*checksum mismatch"):
        validation.validate(config, 1)
    run_dir = tmp_path / "run"
    code = main(
        ["--recipe", "sft_hh", "--set", f"init.parent={tmp_path / 'nope'}", "--run-dir", str(run_dir)]
    )
    assert code == EXIT_BAD_RECIPE
    assert "init.parent" in capsys.readouterr().err and not run_dir.exists()


def test_a_reward_model_is_not_accepted_as_a_policy_parent(parent: dict[str, Path], tmp_path: Path) -> None:
    config = pair_config("reward_hh", parent["hf"], **{"max_steps": "2", "eval_interval": "2"})
    result: TrainResult = train(config, _ctx(tmp_path, run_id="rm", export=False))
    manifest = tmp_path / "objects" / "checkpoints" / "rm" / f"step-{result.step:08d}" / "manifest.json"
    with pytest.raises(RecipeError, match=r"init\.parent: .*is a 'reward' checkpoint"):
        validation.validate(recipes.build("dpo_hh", {"init.parent": str(manifest)}), 1)
