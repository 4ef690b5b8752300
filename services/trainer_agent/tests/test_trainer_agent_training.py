"""Training runtime: recipes refuse bad input, the data pipeline is deterministic and resumable,
checkpoints publish atomically and resume bit-exactly, the export loads in transformers, and
two gloo processes train the same model as one process with the same global batch."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from forge_kit.objectstore import ObjectStore
from forge_kit.paths import resolve_data_path
from forge_trainer_agent.runner import LaunchError, LaunchSpec, TorchrunRunner
from forge_training import recipes, schema, validation
from forge_training.checkpoint import CheckpointManager
from forge_training.data import SamplerState, StepSampler, TokenShards, prepare
from forge_training.run import EXIT_BAD_RECIPE, main
from forge_training.schema import RecipeError, TrainConfig
from forge_training.train import RunContext, lr_factor, pretrain

SHAKESPEARE = resolve_data_path(schema.DEFAULT_CORPUS)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first 40 kB of tinyshakespeare: enough text for a few tiny steps."""
    path = tmp_path_factory.mktemp("corpus") / "shakespeare.txt"
    path.write_text(SHAKESPEARE.read_text(encoding="utf-8")[:40_000], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("token-cache")


def tiny(corpus: Path, **overrides: object) -> TrainConfig:
    config = recipes.build("smoke", {"data.corpus": str(corpus), "threads": 1})
    return dataclasses.replace(config, **overrides)  # type: ignore[arg-type]


def context(tmp_path: Path, cache_dir: Path, **kw: object) -> RunContext:
    return RunContext(
        run_id="run-1",
        run_dir=tmp_path / "run",
        store=ObjectStore(str(tmp_path / "objects")),
        cache_dir=cache_dir,
        **kw,  # type: ignore[arg-type]
    )


# -- recipes ----------------------------------------------------------------------------------


def test_overrides_apply_with_types_and_unknown_keys_are_refused() -> None:
    config = recipes.build(
        "shakespeare_tiny", {"optim.lr": "3e-4", "model.num_layers": "2", "checkpoint.async_save": "false"}
    )
    assert (config.optim.lr, config.model.num_layers, config.checkpoint.async_save) == (3e-4, 2, False)
    with pytest.raises(RecipeError, match=r"unknown recipe key 'optim\.learning_rate'"):
        recipes.build("shakespeare_tiny", {"optim.learning_rate": "1"})
    with pytest.raises(RecipeError, match=r"model\.num_layers: expected int"):
        recipes.build("shakespeare_tiny", {"model.num_layers": "two"})
    with pytest.raises(RecipeError, match="recipe: unknown recipe 'nope'"):
        recipes.build("nope")
    assert schema.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    ("overrides", "world_size", "message"),
    [
        ({"model.num_heads": "3"}, 1, "model.num_heads: 3 does not divide model.hidden_size 128"),
        ({"model.num_kv_heads": "3"}, 1, "model.num_kv_heads"),
        (
            {"global_batch_size": "12", "micro_batch_size": "4"},
            2,
            "global_batch_size: 12 is not divisible by world_size 2",
        ),
        (
            {"data.corpus": "/nonexistent/corpus.txt"},
            1,
            "data.corpus: '/nonexistent/corpus.txt' does not exist",
        ),
        ({"optim.warmup_steps": "5000"}, 1, "optim.warmup_steps"),
    ],
)
def test_impossible_configs_are_refused_with_the_field(
    overrides: dict[str, str], world_size: int, message: str
) -> None:
    config = recipes.build("shakespeare_tiny", overrides)
    with pytest.raises(RecipeError, match=re.escape(message)):
        validation.validate(config, world_size)


def test_empty_corpus_is_refused_and_the_cli_exits_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    code = main(["--recipe", "smoke", "--set", f"data.corpus={empty}", "--run-dir", str(tmp_path / "run")])
    assert code == EXIT_BAD_RECIPE
    assert "data.corpus" in (err := capsys.readouterr().err) and "is empty" in err
    assert not (tmp_path / "run").exists()


def test_learning_rate_warms_up_linearly_then_decays_by_cosine_to_min_lr() -> None:
    config = recipes.build("shakespeare_tiny", {"max_steps": "110", "optim.warmup_steps": "10"})
    factor = lr_factor(config)
    assert [factor(s) for s in (0, 4, 9)] == pytest.approx([1 / 11, 5 / 11, 10 / 11])
    assert factor(10) == pytest.approx(1.0) and factor(60) == pytest.approx((1.0 + 0.1) / 2)
    assert factor(110) == pytest.approx(0.1) and factor(500) == pytest.approx(0.1)  # min_lr / lr


# -- data -------------------------------------------------------------------------------------


def test_shards_round_trip_the_corpus(corpus: Path, cache_dir: Path) -> None:
    config = dataclasses.replace(tiny(corpus).data, shard_tokens=1000)
    prepared = prepare(config, cache_dir / "small-shards")
    train = prepared.split("train")
    index = json.loads((prepared.root / "train" / "index.json").read_text())
    assert len(index["shards"]) > 2 and sum(s["tokens"] for s in index["shards"]) == train.total_tokens
    tok = prepared.tokenizer()
    text = corpus.read_text()[: train.chars]
    assert tok.decode(train.read(0, train.total_tokens).tolist()) == text  # across shard boundaries
    assert train.chars_per_token > 1.2  # even 43 merges compress


def test_sampler_splits_the_global_batch_by_rank_and_resumes_exactly() -> None:
    one = StepSampler(num_windows=50, global_batch=8, seed=3)
    steps_one = [one.next_step(0, 1) for _ in range(12)]  # crosses an epoch boundary (6 steps/epoch)
    # Ranks read disjoint halves of the same global batch; the position is global.
    fresh = [StepSampler(50, 8, 3) for _ in range(2)]
    for expected in steps_one:
        assert fresh[0].next_step(0, 2) + fresh[1].next_step(1, 2) == expected
    epoch0 = [i for step in steps_one[:6] for i in step]
    assert steps_one[6] != steps_one[0] and len(epoch0) == len(set(epoch0))  # no window twice per epoch
    resumed = StepSampler(50, 8, 3, state=SamplerState(epoch=0, cursor=32))
    assert [resumed.next_step(0, 1) for _ in range(8)] == steps_one[4:]


# -- checkpoints ------------------------------------------------------------------------------


def test_torn_and_corrupt_checkpoints_are_skipped_for_the_previous_complete_one(tmp_path: Path) -> None:
    store = ObjectStore(str(tmp_path / "objects"))
    published: list[int] = []
    ckpt = CheckpointManager(store, "r", keep_last=2, on_published=lambda m: published.append(m.step))
    for step in (1, 2, 3):
        ckpt.save(step, {"w": torch.full((4,), float(step))}, {"loss": 1.0})
    ckpt.wait()
    assert published == [1, 2, 3]
    assert not any(k.startswith("checkpoints/r/step-00000001/") for k in store.list())  # keep_last=2
    assert json.loads(store.get_bytes("checkpoints/r/step-00000003/manifest.json"))["meta"][
        "parent"
    ].endswith("step-00000002/manifest.json")
    # A torn step (shard written, no manifest) and a corrupt newest shard are both passed over.
    store.put_bytes("checkpoints/r/step-00000004/rank-00000.pt", b"partial")
    store.put_bytes("checkpoints/r/step-00000003/rank-00000.pt", b"bit rot")
    latest = ckpt.latest_manifest()
    assert latest is not None and latest.step == 2
    assert torch.equal(ckpt.load_shard(latest, 0)["w"], torch.full((4,), 2.0))


def test_async_save_snapshots_state_before_training_mutates_it(tmp_path: Path) -> None:
    ckpt = CheckpointManager(ObjectStore(str(tmp_path)), "r", async_save=True)
    weights = torch.zeros(1000)
    ckpt.save(1, {"w": weights})
    weights += 1  # the loop goes on while the save is in flight
    ckpt.wait()
    manifest = ckpt.latest_manifest()
    assert manifest is not None and float(ckpt.load_shard(manifest, 0)["w"].sum()) == 0.0


# -- training ---------------------------------------------------------------------------------


def test_killed_run_resumes_to_the_bit_exact_loss_curve_and_exports_for_transformers(
    corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    config = tiny(corpus, max_steps=8)
    config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, interval_steps=2))
    full = pretrain(config, context(tmp_path / "full", cache_dir))
    assert full.outcome == "succeeded" and len(full.losses) == 8
    assert full.losses[8] < full.losses[1]
    kill_at = random.Random(7).randint(3, 7)  # a "random" step, fixed for reproducibility
    killed = pretrain(config, context(tmp_path / "resumed", cache_dir, stop_after_step=kill_at))
    assert killed.outcome == "stopped" and killed.step == kill_at
    resumed = pretrain(config, context(tmp_path / "resumed", cache_dir))
    first_resumed = min(resumed.losses)
    assert first_resumed == kill_at - kill_at % 2 + 1  # from the last checkpoint, not from scratch
    for step, loss in resumed.losses.items():
        assert loss == full.losses[step], step  # bit-exact, not approximately equal
    # metrics JSONL in the run directory
    lines = [
        json.loads(line) for line in (tmp_path / "full" / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert {"loss", "lr", "grad_norm", "tokens_per_s"} <= set(lines[0])
    # ... and the loss and learning-rate curves drawn beside it, for the finished and the stopped run.
    for run in ("full", "resumed"):
        png = tmp_path / run / "run" / "curves.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The export loads in plain transformers and gives the trained model's outputs.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert full.export_dir is not None
    assert (full.export_dir / "model.safetensors").exists() and (full.export_dir / "config.json").exists()
    hf = AutoModelForCausalLM.from_pretrained(full.export_dir)
    hf_tok = AutoTokenizer.from_pretrained(full.export_dir)
    prepared = prepare(config.data, cache_dir)
    text = "ROMEO: But soft, what light"
    ids = hf_tok(text)["input_ids"]
    assert ids == prepared.tokenizer().encode(text).ids
    val = TokenShards(prepared.root / "val")
    x = torch.from_numpy(np.stack([val.window(0, 32)]))
    loss = torch.nn.functional.cross_entropy(hf(input_ids=x[:, :-1]).logits[0], x[0, 1:])
    assert 0.5 < float(loss.detach()) < full.losses[1]  # trained, not a random init


# -- entry point and runner -------------------------------------------------------------------


def test_torchrun_runner_builds_standalone_and_rendezvous_commands(tmp_path: Path) -> None:
    runner = TorchrunRunner(torchrun=("torchrun",))
    one = LaunchSpec(job_id="j", attempt=1, command=("python", "-m", "x"), gpu_indices=(0, 1))
    assert runner.command(one) == (
        "torchrun",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--standalone",
        "--no-python",
        "python",
        "-m",
        "x",
    )
    multi = dataclasses.replace(one, num_nodes=2, node_rank=1, master_addr="127.0.0.1", master_port=29500)
    assert "--rdzv-endpoint=127.0.0.1:29500" in runner.command(multi) and "--rdzv-id=j-1" in runner.command(
        multi
    )
    with pytest.raises(LaunchError, match="master_addr"):
        runner.command(dataclasses.replace(one, num_nodes=2))


async def test_a_serving_replica_runs_its_command_itself_not_under_torchrun(tmp_path: Path) -> None:
    """An engine's server is no torch worker: under the torchrun runner it still runs as is."""
    runner = TorchrunRunner(torchrun=("/bin/false",))  # what a torchrun-wrapped job would run
    spec = LaunchSpec(
        job_id="serve",
        attempt=1,
        command=("/bin/sh", "-c", "echo serving on 8123"),
        run_dir=tmp_path / "run",
        log_path=tmp_path / "serve.log",
        serving=True,
    )
    assert (await (await runner.launch(spec)).wait()).code == 0
    assert "serving on 8123" in (tmp_path / "serve.log").read_text()
    trained = dataclasses.replace(spec, serving=False, log_path=tmp_path / "train.log")
    assert (await (await runner.launch(trained)).wait()).code != 0


@pytest.mark.integration
async def test_torchrun_job_of_two_gloo_workers_trains_like_one_process_and_checkpoints_on_sigterm(
    corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """The agent's path: TorchrunRunner starts 2 workers, stop() sends SIGTERM, the workers
    checkpoint together and exit 0; a restart on ONE worker (elastic) resumes from it."""
    prepare(tiny(corpus).data, cache_dir)
    run_dir = tmp_path / "job"
    command = (sys.executable, "-m", "forge_training.run", "--recipe", "smoke", "--cache-dir", str(cache_dir),
               "--set", f"data.corpus={corpus}", "--set", "max_steps=100000", "--set", "checkpoint.interval_steps=0")  # fmt: skip
    spec = LaunchSpec(
        job_id="job-1",
        attempt=1,
        command=command,
        gpu_indices=(0, 1),
        run_dir=run_dir,
        log_path=tmp_path / "job.log",
    )
    proc = await TorchrunRunner().launch(spec)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 90
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert time.monotonic() < deadline, (tmp_path / "job.log").read_text()[-2000:]
        await asyncio.sleep(0.2)
    status = await proc.stop(grace_s=60)
    # Exited inside the grace (torchrun itself ends with 1 on SIGTERM; the agent reports PREEMPTED).
    assert status.signal is None, (tmp_path / "job.log").read_text()[-2000:]
    summary = json.loads(
        [ln for ln in (tmp_path / "job.log").read_text().splitlines() if ln.startswith("{")][-1]
    )
    assert summary["outcome"] == "preempted"
    store = ObjectStore(str(run_dir / "objects"))
    key = f"checkpoints/job-1/step-{summary['step']:08d}/manifest.json"
    manifest = json.loads(store.get_bytes(key))
    assert manifest["world_size"] == 2 and len(manifest["files"]) == 2  # one shard per rank
    # Data parallel = same global batch: the 2-worker losses match a 1-process run's.
    logged = {r["step"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r}
    single = pretrain(tiny(corpus, max_steps=3), context(tmp_path / "single", cache_dir, export=False))
    for step in (1, 2, 3):
        assert logged[step] == pytest.approx(single.losses[step], rel=1e-4)
    # Elastic: the job restarted with one worker resumes from the 2-worker checkpoint.
    resumed_cfg = tiny(corpus, max_steps=summary["step"] + 2)
    ctx = RunContext(run_id="job-1", run_dir=run_dir, store=store, cache_dir=cache_dir, export=False)
    resumed = pretrain(resumed_cfg, ctx)
    assert sorted(resumed.losses) == [summary["step"] + 1, summary["step"] + 2]
