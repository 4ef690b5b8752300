"""The ``rerank`` task (``rerank_beir_minilm``): the reranker's cross-encoder, trained by the
training runtime from the bundled MiniLM on a tiny BEIR folder written here."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
from transformers import BertConfig, BertForSequenceClassification

from forge_kit.objectstore import ObjectStore
from forge_training import recipes, validation
from forge_training.launch import run_group_sequence
from forge_training.objectives.rerank import CrossEncoderRanking
from forge_training.rerank import (
    Bm25,
    build_groups,
    read_dataset,
    split_queries,
)
from forge_training.run import EXIT_BAD_RECIPE, main
from forge_training.schema import OptimConfig, RecipeError, RerankConfig
from forge_training.train import RunContext, param_groups, train

DOCS = {
    "d1": ("Volcanoes", "volcanic eruptions emit sulphur dioxide and ash into the atmosphere"),
    "d2": ("Bread", "yeast makes bread dough rise by producing carbon dioxide"),
    "d3": ("Climate", "sulphur dioxide aerosols from eruptions cool the climate for a year"),
    "d4": ("Oceans", "carbon dioxide dissolves in oceans and lowers their ph"),
    "d5": ("Soil", "volcanic ash makes fertile soil for farming"),
    "d6": ("Glaciers", "glaciers melt faster as the climate warms and oceans rise"),
    "d7": ("Coffee", "coffee beans are roasted to release aroma and carbon dioxide"),
    "d8": ("Wine", "yeast ferments grape sugar into wine and carbon dioxide"),
}
QUERIES = {
    "q1": ("do eruptions emit sulphur dioxide", "d1"),
    "q2": ("how does yeast make bread dough", "d2"),
    "q3": ("ocean acidity from carbon dioxide", "d4"),
    "q4": ("does volcanic ash help farming soil", "d5"),
    "q5": ("why do glaciers melt as climate warms", "d6"),
    "q6": ("coffee roasting releases carbon dioxide", "d7"),
    "q7": ("yeast ferments grape sugar into wine", "d8"),
    "q8": ("sulphur aerosols cool the climate", "d3"),
    "q9": ("knead dough", "d2"),  # shares words with its relevant document only: no hard negative
}


def write_beir(root: Path, name: str = "tiny") -> Path:
    folder = root / name
    (folder / "qrels").mkdir(parents=True)
    with open(folder / "corpus.jsonl", "w") as f:
        for doc_id, (title, text) in DOCS.items():
            f.write(json.dumps({"_id": doc_id, "title": title, "text": text}) + "\n")
    with open(folder / "queries.jsonl", "w") as f:
        for qid, (text, _) in QUERIES.items():
            f.write(json.dumps({"_id": qid, "text": text}) + "\n")
    (folder / "qrels" / "train.tsv").write_text(
        "query-id\tcorpus-id\tscore\n" + "".join(f"{q}\t{d}\t1\n" for q, (_, d) in QUERIES.items())
    )
    return folder


def tiny(root: Path, **extra: str) -> dict[str, str]:
    """Overrides of ``rerank_beir_minilm`` for the folder of :func:`write_beir`: one hard negative
    from the BM25 top 5, 2 of the 8 usable queries held out, 32 word pieces."""
    return {
        "rerank.root": str(root),
        "rerank.datasets": "tiny",
        "rerank.negatives": "1",
        "rerank.negative_depth": "5",
        "data.val_fraction": "0.25",
        "data.seq_len": "32",
        "global_batch_size": "2",
        "micro_batch_size": "1",
        "max_steps": "2",
        "eval_interval": "2",
        "eval_batches": "4",
        "optim.warmup_steps": "0",
        "log_interval": "1",
        "checkpoint.interval_steps": "0",
        "threads": "1",
        **extra,
    }


def test_bm25_ranks_by_shared_rare_terms() -> None:
    bm25 = Bm25([f"{t} {x}" for t, x in DOCS.values()])
    assert bm25.top("sulphur eruptions", 2) == [0, 2]
    assert bm25.top("nothing matches", 3) == []


def test_groups_put_the_positive_first_and_never_a_judged_document_among_negatives(tmp_path: Path) -> None:
    write_beir(tmp_path)
    data = read_dataset(tmp_path, "tiny")
    config = RerankConfig(negatives=1, negative_depth=5)
    groups = build_groups(data, sorted(data.positives), config, random.Random(0), limit=100)
    assert sorted(g.query for g in groups) == sorted(text for q, (text, _) in QUERIES.items() if q != "q9")
    for group in groups:
        positive = next(d for text, d in QUERIES.values() if text == group.query)
        assert group.passages[0] == "\n".join(DOCS[positive])
        assert len(group.passages) == 2 and group.passages[1] != group.passages[0]
    assert len(build_groups(data, sorted(data.positives), config, random.Random(0), limit=3)) == 3


def test_positives_are_the_relevant_documents_bm25_retrieves(tmp_path: Path) -> None:
    folder = write_beir(tmp_path)
    # d2 (bread) is also judged relevant to q4 (volcanic soil), which BM25 never matches with it.
    with open(folder / "qrels" / "train.tsv", "a") as f:
        f.write("q4\td2\t1\n")
    data = read_dataset(tmp_path, "tiny")
    near = RerankConfig(negatives=1, negative_depth=5, positive_depth=5)
    soil = QUERIES["q4"][0]
    positives = {
        g.passages[0] for g in build_groups(data, ["q4"], near, random.Random(0), 10) if g.query == soil
    }
    assert positives == {"\n".join(DOCS["d5"])}
    every = RerankConfig(negatives=1, negative_depth=5, positive_depth=0)
    positives = {g.passages[0] for g in build_groups(data, ["q4"], every, random.Random(0), 10)}
    assert positives == {"\n".join(DOCS["d5"]), "\n".join(DOCS["d2"])}


def test_held_out_queries_are_whole_and_fixed_by_the_seed(tmp_path: Path) -> None:
    write_beir(tmp_path)
    data = read_dataset(tmp_path, "tiny")
    train_q, held = split_queries(data, seed=7, val_fraction=0.25)
    assert len(held) == 2 and sorted(train_q + held) == sorted(QUERIES) and not set(train_q) & set(held)
    assert split_queries(data, seed=7, val_fraction=0.25) == (train_q, held)
    assert split_queries(data, seed=8, val_fraction=0.25) != (train_q, held)


def test_a_fresh_head_learns_faster_and_frozen_embeddings_are_left_out() -> None:
    model = BertForSequenceClassification(
        BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                   intermediate_size=16, num_labels=1)
    )  # fmt: skip
    model.get_input_embeddings().weight.requires_grad_(False)
    heads = ("classifier.", "bert.pooler.")
    groups = param_groups(model, OptimConfig(lr=1e-5, weight_decay=0.01, head_lr_scale=10.0), heads)
    by_param = {id(p): g for g in groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert id(named["bert.embeddings.word_embeddings.weight"]) not in by_param
    assert len(by_param) == sum(p.requires_grad for p in model.parameters())
    for name in ("classifier.weight", "bert.pooler.dense.weight"):
        assert by_param[id(named[name])]["lr"] == pytest.approx(1e-4)
        assert by_param[id(named[name])]["weight_decay"] == 0.01
    assert by_param[id(named["classifier.bias"])]["weight_decay"] == 0.0
    layer = "bert.encoder.layer.0.attention.output."
    assert by_param[id(named[layer + "dense.weight"])]["lr"] == pytest.approx(1e-5)
    assert by_param[id(named[layer + "LayerNorm.weight"])]["weight_decay"] == 0.0
    assert groups[0]["params"][0] is named["bert.embeddings.position_embeddings.weight"]  # body first
    # Without a scale the groups are the two every other run has (its checkpoints still load).
    plain = param_groups(model, OptimConfig(lr=1e-5, weight_decay=0.01), heads)
    assert [g["weight_decay"] for g in plain] == [0.01, 0.0]


def test_the_recipe_is_validated_before_anything_starts(tmp_path: Path) -> None:
    write_beir(tmp_path)
    config = recipes.build("rerank_beir_minilm", tiny(tmp_path))
    assert config.task == "rerank" and config.init.backbone == "minilm"
    validation.validate(config, 1)
    bad = {
        "rerank.datasets": ("tiny,missing", r"rerank\.datasets: '.*missing' has no corpus\.jsonl"),
        "rerank.negative_depth": ("0", r"rerank\.negative_depth: must be positive"),
        "init.backbone": ("parent", r"init\.backbone: the 'rerank' task trains a bundled encoder"),
        "optim.head_lr_scale": ("0", r"optim\.head_lr_scale: must be positive"),
        "data.seq_len": ("8", r"data\.seq_len: a query and a passage need at least 16"),
    }
    for key, (value, message) in bad.items():
        with pytest.raises(RecipeError, match=message):
            validation.validate(recipes.build("rerank_beir_minilm", tiny(tmp_path, **{key: value})), 1)
    with pytest.raises(RecipeError, match=r"pairs\.path: not used by the 'rerank' task"):
        recipes.build("rerank_beir_minilm", {"pairs.path": "/x"})
    with pytest.raises(RecipeError, match=r"rerank\.negatives: not used by the 'reward' task"):
        recipes.build("reward_hh_minilm", {"rerank.negatives": "2"})
    args = ["--recipe", "rerank_beir_minilm", "--run-dir", str(tmp_path / "run")]
    assert main([*args, "--set", f"rerank.root={tmp_path / 'nowhere'}"]) == EXIT_BAD_RECIPE


def test_training_reports_held_out_ranking_and_exports_what_the_reranker_serves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scoring = pytest.importorskip("forge_reranker.scoring")
    write_beir(tmp_path)
    run_dir = tmp_path / "run"
    args = ["--recipe", "rerank_beir_minilm", "--run-dir", str(run_dir), "--run-id", "ce"]
    args += ["--cache-dir", str(tmp_path / "cache")]
    for key, value in tiny(tmp_path).items():
        args += ["--set", f"{key}={value}"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ev = summary["eval"]
    assert summary["outcome"] == "succeeded" and summary["step"] == 2
    assert ev["eval_groups"] == 2 and ev["chance_loss"] == pytest.approx(math.log(2))
    assert 0.0 <= ev["val_rank_accuracy_low"] <= ev["val_rank_accuracy"] <= ev["val_rank_accuracy_high"] <= 1
    assert 0.5 <= ev["val_mrr"] <= 1.0  # two passages a group: the relevant one ranks 1st or 2nd
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["step"] == 0 and "val_rank_accuracy" in metrics[0]  # the untrained baseline
    trained = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in trained] == [1, 2] and all("rank_accuracy" in m for m in trained)
    manifest = json.loads((run_dir / "objects/checkpoints/ce/step-00000002/manifest.json").read_text())
    meta = manifest["meta"]
    assert meta["task"] == "rerank" and "all-MiniLM-L6-v2" in meta["backbone"]
    assert meta["groups"] == {"tiny": {"train_groups": 6, "heldout_groups": 2}}
    # The export is a Hugging Face cross-encoder the reranker loads by path, cut at 32 pieces.
    export = Path(summary["export_dir"])
    assert json.loads((export / "tokenizer_config.json").read_text())["model_max_length"] == 32
    scorer = scoring.CrossEncoderScorer(export, max_tokens=32, int8=False)
    scores = scorer.score(QUERIES["q1"][0], [DOCS["d1"][1], DOCS["d2"][1]])
    assert len(scores) == 2 and scores[0] != scores[1]


def test_the_loop_overfits_a_few_groups_well_below_chance(tmp_path: Path) -> None:
    """The learning check: the same groups for many steps must be learnt, which a wrong target, a
    loss over the wrong axis, a frozen or dead head or a gradient never applied would all prevent."""
    write_beir(tmp_path)
    extra = {"max_steps": "24", "optim.lr": "1e-4", "optim.min_lr": "1e-4", "eval_interval": "24"}
    config = recipes.build("rerank_beir_minilm", tiny(tmp_path, **extra))
    ctx = RunContext(run_id="fit", run_dir=tmp_path / "run", store=ObjectStore(str(tmp_path / "objects")),
                     cache_dir=tmp_path / "cache", export=False)  # fmt: skip
    result = train(config, ctx)
    first, last = result.losses[1], sum(result.losses[k] for k in (22, 23, 24)) / 3
    assert first == pytest.approx(math.log(2), abs=0.3)
    assert last < 0.25 * math.log(2), result.losses
    # ... and learnt with the relevant passage on top (the figure reads column 0, not the target).
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["rank_accuracy"] for m in metrics if m.get("step", 0) >= 22 and "loss" in m] == [1.0, 1.0, 1.0]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    """The DDP and the FSDP run of 2 processes, one after the other on one gloo group (one
    start-up of the spawned processes): parallelism -> (the folder, rank 0's figures)."""
    root = tmp_path_factory.mktemp("rerank-gloo")
    write_beir(root)
    configs = [recipes.build("rerank_beir_minilm", _without_dropout(root, p)) for p in ("ddp", "fsdp")]
    doubles = run_group_sequence(
        [(c, root / f"two-{c.parallelism}") for c in configs], 2, cache_dir=root / "cache"
    )
    return {c.parallelism: (root, d) for c, d in zip(configs, doubles, strict=True)}


def _without_dropout(root: Path, parallelism: str) -> dict[str, str]:
    return tiny(root, **{"init.encoder_dropout": "0", "parallelism": parallelism})


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_two_gloo_processes_train_the_cross_encoder_like_one(
    two_processes: dict[str, tuple[Path, dict[str, Any]]], tmp_path: Path, parallelism: str
) -> None:
    """Data parallel: 2 processes with a group each per step match 1 process with both, step by
    step and on the held-out figures (the groups are split by rank and the sums all-reduced);
    without dropout, whose masks each process draws from its own generator. FSDP shards the
    encoder's blocks (its frozen embeddings included) and trains the same."""
    root, double = two_processes[parallelism]
    config = recipes.build("rerank_beir_minilm", _without_dropout(root, parallelism))
    assert double["outcome"] == "succeeded" and sorted(double["losses"]) == [1, 2]
    ctx = RunContext(run_id="one", run_dir=tmp_path / "one", store=ObjectStore(str(tmp_path / "o1")),
                     cache_dir=root / "cache", export=False)  # fmt: skip
    single = train(config, ctx)
    for step in (1, 2):
        assert double["losses"][step] == pytest.approx(single.losses[step], rel=1e-4), step
    for key in ("val_loss", "val_mrr", "eval_groups"):
        assert double["eval_metrics"][key] == pytest.approx(single.eval_metrics[key], rel=1e-4), key


def test_later_epochs_draw_each_groups_negatives_again_reproducibly(tmp_path: Path) -> None:
    write_beir(tmp_path)
    extra = {"rerank.negative_depth": "8"}  # pools of several candidates
    objective = CrossEncoderRanking(recipes.build("rerank_beir_minilm", tiny(tmp_path, **extra)), 0, 1)
    n = len(objective.train_groups)
    first = [objective.passages(i, 0) for i in range(n)]
    assert first == [g.passages for g in objective.train_groups]  # epoch 0: the build-time draw
    later = [[objective.passages(i, epoch) for i in range(n)] for epoch in (1, 2)]
    assert later[0] != first and later[1] != later[0]
    for epoch in later:
        for group, drawn in zip(objective.train_groups, epoch, strict=True):
            assert drawn[0] == group.passages[0] and len(drawn) == 2 and drawn[1] in group.pool
    assert [objective.passages(i, 1) for i in range(n)] == later[0]  # a resume sees the same groups
    fixed = recipes.build(
        "rerank_beir_minilm", tiny(tmp_path, **extra, **{"rerank.resample_negatives": "false"})
    )
    still = CrossEncoderRanking(fixed, 0, 1)
    assert [still.passages(i, 3) for i in range(n)] == first
    # The sampler tags each item with its epoch, and the batch encodes those passages.
    items = objective.sampler.next_step(0, 1)
    assert all(epoch == 0 for _, epoch in items)
    micro = objective.collate(items)
    assert micro["input_ids"].shape[0] == 2 * len(items)
