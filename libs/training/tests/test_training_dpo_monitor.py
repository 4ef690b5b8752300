"""DPO's over-optimisation monitor during training (``dpo.monitor.*``), on tiny real models.

The scenario is reward hacking as it happens: the proxy reward model and most of DPO's training
pairs come from labels that disagree with the held-out human preferences (the same HH-RLHF
conversations with chosen and rejected swapped). As DPO follows them, the proxy reward of the
policy's samples goes up while the policy's agreement with the held-out human pairs goes down,
and training stops at the check where that shows, before ``max_steps``, with the reason and the
trace. With the monitor off the same run trains to the end.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from forge_kit.objectstore import ObjectStore
from forge_kit.paths import resolve_data_path
from forge_training import recipes, schema, validation
from forge_training.schema import RecipeError
from forge_training.train import RunContext, train

HH = resolve_data_path("preferences/hh-rlhf/helpful-base/test.jsonl.gz")
TINY_SHAPE = {
    "model.hidden_size": "32",
    "model.intermediate_size": "64",
    "model.num_heads": "2",
    "model.num_kv_heads": "2",
}
SMALL = {
    "global_batch_size": "4",
    "micro_batch_size": "2",
    "log_interval": "1",
    "threads": "1",
    "optim.warmup_steps": "1",
    "checkpoint.interval_steps": "0",
    "data.seq_len": "48",
}


def _ctx(root: Path, run_id: str) -> RunContext:
    return RunContext(
        run_id=run_id,
        run_dir=root / run_id,
        store=ObjectStore(str(root / "objects")),
        cache_dir=root / "cache",
    )


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    with gzip.open(path, "wt", encoding="utf-8") as sink:
        for row in rows:
            sink.write(json.dumps(row) + "\n")
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("overopt")
    corpus = root / "shakespeare.txt"
    corpus.write_text(resolve_data_path(schema.DEFAULT_CORPUS).read_text(encoding="utf-8")[:40_000])
    parent = train(
        # The shape this test's over-optimisation was worked out on (smoke's former 2 heads of 16).
        recipes.build("smoke", {"data.corpus": str(corpus), "max_steps": "3", "threads": "1", **TINY_SHAPE}),
        _ctx(root, "parent"),
    ).export_dir
    assert parent is not None
    with gzip.open(HH, "rt", encoding="utf-8") as lines:
        rows = [json.loads(next(lines)) for _ in range(260)]
    human = _write(root / "human.jsonl.gz", rows[:60])
    hacked = _write(
        root / "hacked.jsonl.gz", [{"chosen": r["rejected"], "rejected": r["chosen"]} for r in rows[60:]]
    )
    # The proxy reward model learns the swapped labels.
    rm = train(
        recipes.build(
            "reward_hh",
            {
                **SMALL,
                "init.parent": str(parent),
                "pairs.path": str(hacked),
                "max_steps": "10",
                "optim.lr": "1e-2",
                "eval_interval": "10",
                "eval_batches": "1",
            },
        ),
        _ctx(root, "rm"),
    ).export_dir
    assert rm is not None
    return {"root": root, "parent": parent, "human": human, "hacked": hacked, "rm": rm}


def dpo(setup: dict[str, Path], **extra: str) -> schema.TrainConfig:
    return recipes.build(
        "dpo_hh",
        {
            **SMALL,
            "init.parent": str(setup["parent"]),
            "pairs.path": str(setup["human"]),
            "pairs.extra_train": str(setup["hacked"]),
            "data.val_fraction": "0.2",
            "optim.lr": "1e-2",
            "optim.min_lr": "1e-2",
            "max_steps": "16",
            "eval_interval": "100",
            "eval_batches": "6",
            **extra,
        },
    )


def test_dpo_stops_early_when_the_proxy_reward_rises_while_held_out_agreement_falls(
    setup: dict[str, Path], tmp_path: Path
) -> None:
    trace_path = tmp_path / "monitor.json"
    config = dpo(
        setup,
        **{
            "dpo.monitor.interval": "2",
            "dpo.monitor.reward_model": str(setup["rm"]),
            "dpo.monitor.window": "2",
            "dpo.monitor.prompts": "4",
            "dpo.monitor.max_new_tokens": "8",
            "dpo.monitor.out": str(trace_path),
        },
    )
    validation.validate(config, 1)
    result = train(config, _ctx(tmp_path, "dpo"))
    trace = json.loads(trace_path.read_text())
    points = trace["points"]
    assert result.early_stop and result.early_stop == trace["early_stop"]
    assert result.early_stop.startswith("over-optimisation at step")
    assert result.step < 16 and points[-1]["step"] == result.step  # stopped at the check that showed it
    assert [p["step"] for p in points] == list(range(0, result.step + 1, 2))
    assert points[0]["kl"] == 0.0 and points[0]["heldout_agreement"] == 0.5  # the reference point
    before, last = points[-2], points[-1]
    assert (
        last["proxy_reward"] > before["proxy_reward"]
        and last["heldout_agreement"] < before["heldout_agreement"]
    )
    assert all(p["kl"] >= 0.0 for p in points)
    metrics = [json.loads(line) for line in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()]
    assert any(m.get("early_stopped") == 1.0 and m["step"] == result.step for m in metrics)
    assert result.export_dir is not None  # the policy at the stop is still exported


def test_without_the_monitor_the_same_run_trains_to_the_end(setup: dict[str, Path], tmp_path: Path) -> None:
    result = train(dpo(setup, max_steps="6"), _ctx(tmp_path, "dpo"))
    assert result.step == 6 and result.early_stop == ""


def test_a_monitor_without_a_reward_model_is_refused(setup: dict[str, Path], tmp_path: Path) -> None:
    for extra, field in (
        ({"dpo.monitor.interval": "2"}, "dpo.monitor.reward_model"),
        (
            {"dpo.monitor.interval": "2", "dpo.monitor.reward_model": str(tmp_path)},
            "dpo.monitor.reward_model",
        ),
        (
            {
                "dpo.monitor.interval": "2",
                "dpo.monitor.reward_model": str(setup["rm"]),
                "dpo.monitor.window": "0",
            },
            "dpo.monitor.window",
        ),
    ):
        with pytest.raises(RecipeError, match=field):
            validation.validate(dpo(setup, **extra), 1)
