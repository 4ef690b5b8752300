"""The GPU path's decisions on a CPU machine: which device and backend a rank takes (a rank with no
GPU; a rank given GPUs, faked at :mod:`forge_training.device`'s boundary, ``torch.cuda``), the
recipe's precision (a real bf16 and fp16 training run on the CPU, the fp16 loss scaler), the
attention kernel, activation checkpointing, the MFU peak table (known parts, an unknown part gets
no MFU), and a CUDA out-of-memory failure classified with the planner's figures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from forge_kit.jobenv import TERMINATION_LOG_ENV
from forge_kit.objectstore import ObjectStore
from forge_kit.paths import resolve_data_path
from forge_training import device, recipes, run, schema, validation
from forge_training.mfu import GPU_PEAK_FLOPS, gpu_peak_flops, peak_flops
from forge_training.objectives.pretrain import model_config
from forge_training.precision import Amp, attention_kernel
from forge_training.schema import MetricsConfig, RecipeError
from forge_training.train import RunContext, TrainResult, train

SHAKESPEARE = resolve_data_path(schema.DEFAULT_CORPUS)


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """CUDA as a node with ``count`` GPUs exposes it to torch (only what :func:`device.select`
    asks: whether CUDA is available and how many devices it shows)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


# -- placement ----------------------------------------------------------------------------------


def test_a_rank_without_a_gpu_trains_on_the_cpu_over_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpus(monkeypatch, 0)
    chosen = device.select("auto", {"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": ""})
    assert chosen == torch.device("cpu")
    assert device.backend_for(chosen) == "gloo"
    # What the machine itself says (no GPU here): the same.
    monkeypatch.undo()
    assert device.select("auto", {}) == torch.device("cpu")


def test_a_rank_given_gpus_binds_cuda_local_rank_and_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpus(monkeypatch, 2)  # the agent gave the job GPUs 4 and 5: CUDA numbers them 0 and 1
    env = {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert device.select("auto", {**env, "LOCAL_RANK": "0"}) == torch.device("cuda", 0)
    second = device.select("auto", {**env, "LOCAL_RANK": "1"})
    assert second == torch.device("cuda", 1)
    assert device.backend_for(second) == "nccl"
    assert device.select("cuda", {**env, "LOCAL_RANK": "1"}) == second


def test_the_backend_follows_the_device_not_the_presence_of_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpus(monkeypatch, 8)
    cpu = device.select("cpu", {"LOCAL_RANK": "0"})
    assert cpu == torch.device("cpu") and device.backend_for(cpu) == "gloo"


def test_more_ranks_than_gpus_and_cuda_without_a_gpu_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpus(monkeypatch, 2)
    with pytest.raises(RecipeError, match="local rank 2 has no GPU of its own: 2 visible"):
        device.select("auto", {"LOCAL_RANK": "2", "CUDA_VISIBLE_DEVICES": "0,1"})
    with pytest.raises(RecipeError, match="LOCAL_RANK"):
        device.select("auto", {"LOCAL_RANK": "-1"})
    with pytest.raises(RecipeError, match="LOCAL_RANK"):
        device.select("auto", {"LOCAL_RANK": "../0"})
    with pytest.raises(RecipeError, match="device: must be one of"):
        device.select("tpu", {})
    _fake_gpus(monkeypatch, 0)
    with pytest.raises(RecipeError, match="cuda asked for, but this rank sees no GPU"):
        device.select("cuda", {"CUDA_VISIBLE_DEVICES": ""})


def test_the_entry_point_refuses_a_cuda_recipe_on_a_machine_without_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_gpus(monkeypatch, 0)
    log = tmp_path / "termination"
    monkeypatch.setenv(TERMINATION_LOG_ENV, str(log))
    code = run.main(["--recipe", "smoke", "--set", "device=cuda", "--run-dir", str(tmp_path / "run")])
    assert code == run.EXIT_BAD_RECIPE
    assert "device: cuda asked for" in log.read_text()
    assert not (tmp_path / "run").exists()


def test_cpu_batches_are_neither_pinned_nor_copied() -> None:
    batch = {"input_ids": torch.arange(6).reshape(2, 3)}
    cpu = torch.device("cpu")
    assert device.pin(batch, cpu) is batch
    moved = device.to_device(batch, cpu)
    assert moved["input_ids"] is batch["input_ids"]
    assert device.rng_state(cpu) is None and device.memory_figures(cpu) == {}


# -- recipe keys ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "world_size", "message"),
    [
        ({"precision": "fp8"}, 1, "precision: must be one of fp32, bf16, fp16"),
        ({"device": "tpu"}, 1, "device: must be one of auto, cpu, cuda"),
        ({"precision": "fp16", "parallelism": "fsdp"}, 2, "precision: fp16 needs loss scaling"),
        ({"compile": "maybe"}, 1, "compile: expected bool"),
        ({"activation_checkpointing": "2"}, 1, "activation_checkpointing: expected bool"),
    ],
)
def test_bad_precision_and_device_settings_are_refused(
    overrides: dict[str, str], world_size: int, message: str
) -> None:
    with pytest.raises(RecipeError, match=message):
        config = recipes.build("smoke", {"data.corpus": str(SHAKESPEARE), **overrides})
        validation.validate(config, world_size)


def test_fp16_under_ddp_and_bf16_under_fsdp_are_accepted() -> None:
    for overrides in ({"precision": "fp16"}, {"precision": "bf16", "parallelism": "fsdp"}):
        config = recipes.build("smoke", {"data.corpus": str(SHAKESPEARE), **overrides})
        validation.validate(config, 2)


# -- precision ------------------------------------------------------------------------------------


def test_only_fp16_gets_a_loss_scaler_and_autocast_keeps_fp32_master_weights() -> None:
    cpu = torch.device("cpu")
    assert Amp("fp32", cpu).scaler is None and Amp("bf16", cpu).scaler is None
    fp16 = Amp("fp16", cpu)
    assert isinstance(fp16.scaler, torch.amp.GradScaler)
    layer = torch.nn.Linear(8, 8)
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        with Amp(precision, cpu).autocast():
            assert layer(torch.randn(2, 8)).dtype == dtype
        assert layer.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="precision"):
        Amp("fp8", cpu)


def test_models_run_scaled_dot_product_attention() -> None:
    config = recipes.build("smoke", {"data.corpus": str(SHAKESPEARE)})
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(model_config(config, 300, 0))
    assert attention_kernel(model) == "sdpa"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "shakespeare.txt"
    path.write_text(SHAKESPEARE.read_text(encoding="utf-8")[:40_000], encoding="utf-8")
    return path


def _run(root: Path, corpus: Path, **overrides: str) -> tuple[TrainResult, list[dict[str, Any]]]:
    config = recipes.build(
        "smoke", {"data.corpus": str(corpus), "max_steps": "6", "threads": "1", **overrides}
    )
    ctx = RunContext(
        run_id="run", run_dir=root / "run", store=ObjectStore(str(root / "objects")), cache_dir=root / "cache"
    )
    result = train(config, ctx)
    lines = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    return result, lines


@pytest.fixture(scope="module")
def fp32(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainResult:
    return _run(tmp_path_factory.mktemp("fp32"), corpus)[0]


def test_a_bf16_run_on_the_cpu_trains_close_to_fp32_with_fp32_weights(
    corpus: Path, fp32: TrainResult, tmp_path: Path
) -> None:
    result, _ = _run(tmp_path, corpus, precision="bf16")
    assert result.outcome == "succeeded" and result.step == 6
    # Autocast was in effect: not fp32's losses bit for bit, but within bf16's rounding.
    assert result.losses != fp32.losses
    for step, loss in fp32.losses.items():
        assert result.losses[step] == pytest.approx(loss, rel=0.02)
    assert result.val_loss == pytest.approx(fp32.val_loss, rel=0.02)
    exported = result.export_dir
    assert exported is not None
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(exported).dtype == torch.float32


def test_an_fp16_run_scales_its_loss_and_resumes_the_scale(corpus: Path, tmp_path: Path) -> None:
    result, _ = _run(tmp_path, corpus, precision="fp16")
    assert result.outcome == "succeeded"
    assert all(loss == loss for loss in result.losses.values())  # no NaN reached the weights
    manifest = ObjectStore(str(tmp_path / "objects"))
    shard = manifest.get_bytes("checkpoints/run/step-00000006/rank-00000.pt")
    import io

    state = torch.load(io.BytesIO(shard), weights_only=True)
    assert state["scaler"]["scale"] > 1.0  # the GradScaler's state travels with the checkpoint


def test_activation_checkpointing_recomputes_to_the_same_losses(
    corpus: Path, fp32: TrainResult, tmp_path: Path
) -> None:
    result, _ = _run(tmp_path, corpus, activation_checkpointing="true")
    for step, loss in fp32.losses.items():
        assert result.losses[step] == pytest.approx(loss, rel=1e-5)


# -- MFU peaks ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA A100-SXM4-40GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA A10G", 70e12),
        ("NVIDIA A10", 125e12),
    ],
)
def test_the_peak_of_a_known_gpu_comes_from_the_table(name: str, peak: float) -> None:
    assert gpu_peak_flops(name) == peak


def test_an_unknown_gpu_gets_no_peak_and_its_run_no_mfu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert gpu_peak_flops("NVIDIA GeForce RTX 4090") is None
    assert gpu_peak_flops("NVIDIA A1000") is None  # not an A100 nor an A10
    assert all(flops > 0 for _, flops in GPU_PEAK_FLOPS)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce RTX 4090")
    gpu = torch.device("cuda", 0)
    assert peak_flops(MetricsConfig(), gpu) is None
    assert peak_flops(MetricsConfig(peak_flops=1e14), gpu) == 1e14  # a configured peak wins


# -- out of memory ------------------------------------------------------------------------------


def test_a_cuda_oom_is_told_apart_from_other_failures() -> None:
    assert device.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert device.is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 20 MiB"))
    assert not device.is_out_of_memory(RuntimeError("NCCL error: unhandled system error"))
    assert not device.is_out_of_memory(MemoryError())
    assert not device.is_out_of_memory(ValueError("CUDA out of memory"))


def test_an_oom_exits_3_with_the_figures_the_planner_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The allocator's failure is raised where the loop would see it (``train``); the entry point
    classifies it and writes the termination message the agent reports."""

    def out_of_memory(config: schema.TrainConfig, ctx: RunContext) -> TrainResult:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total)")

    monkeypatch.setattr(run, "train", out_of_memory)
    log = tmp_path / "termination"
    monkeypatch.setenv(TERMINATION_LOG_ENV, str(log))
    args = ["--recipe", "smoke", "--set", f"data.corpus={SHAKESPEARE}", "--set", "micro_batch_size=1"]
    assert run.main([*args, "--run-dir", str(tmp_path / "run")]) == run.EXIT_OUT_OF_MEMORY
    message = log.read_text()
    assert message.startswith("cuda out of memory: ")
    report = json.loads(message.removeprefix("cuda out of memory: "))
    assert report["failure"] == "cuda_out_of_memory"
    assert report["micro_batch_size"] == 1 and report["global_batch_size"] == 4
    assert report["seq_len"] == 32 and report["model"]["num_layers"] == 2
    assert report["parallelism"] == "ddp" and report["precision"] == "fp32"
    assert "Tried to allocate 2.00 GiB" in report["error"]
    assert len(message) < 1000  # the agent keeps 1000 characters of a failure message
