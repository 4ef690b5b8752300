"""The parallelism planner: formulas against hand-computed figures, the search, and ``forge plan``."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from forge_training.plan import cost as plan_cost
from forge_training.plan import planner as P
from forge_training.plan import spec as plan_spec
from forge_training.plan.cli import app
from forge_training.plan.spec import GIB, ParallelConfig, PlanError, PlanRequest, Recompute

LLAMA_70B = plan_spec.MODEL_PRESETS["llama-70b"]
A100_80 = plan_spec.GPU_PRESETS["a100-80gb"]


def request(**overrides: object) -> PlanRequest:
    """llama-70b on 512 A100-80GB, 4096-token sequences, 4M tokens per step, unless overridden."""
    fields: dict[str, object] = {
        "model": LLAMA_70B,
        "gpu": A100_80,
        "gpus": 512,
        "seq_len": 4096,
        "global_batch_seqs": 1024,
    }
    fields.update(overrides)
    return PlanRequest(**fields)  # type: ignore[arg-type]


def config(
    tp: int, pp: int, dp: int, zero: int, recompute: Recompute, m: int, sp: bool = True
) -> ParallelConfig:
    return ParallelConfig(tp, pp, dp, zero, recompute, micro_batch=1, micro_batches=m, sequence_parallel=sp)


# ----------------------------------------------------------------------------------------------- formulas


@pytest.mark.parametrize(
    ("name", "params"),
    [
        # The published parameter counts of the Hugging Face checkpoints.
        ("llama-7b", 6_738_415_616),
        ("llama-13b", 13_015_864_320),
        ("llama-70b", 68_976_648_192),
    ],
)
def test_preset_parameter_counts(name: str, params: int) -> None:
    assert plan_spec.param_count(plan_spec.MODEL_PRESETS[name]) == params


@pytest.mark.parametrize(
    ("params", "dp", "zero", "total"),
    [
        (7e9, 1, 0, 112e9),  # 7B × 16 bytes before sharding
        (7e9, 8, 1, 7e9 * (2 + 2 + 12 / 8)),  # 38.5 GB
        (7e9, 8, 2, 7e9 * (2 + 14 / 8)),  # 26.25 GB
        (7e9, 8, 3, 14e9),
        # ZeRO paper, figure 1: 7.5B parameters on 64 GPUs.
        (7.5e9, 64, 0, 120e9),
        (7.5e9, 64, 1, 31.40625e9),
        (7.5e9, 64, 2, 16.640625e9),
        (7.5e9, 64, 3, 1.875e9),
    ],
)
def test_model_state_bytes(params: float, dp: int, zero: int, total: float) -> None:
    assert sum(plan_cost.model_state_bytes(params, dp, zero)) == pytest.approx(total)


def test_model_state_split_by_zero_stage() -> None:
    assert plan_cost.model_state_bytes(1e9, 4, 0) == (2e9, 2e9, 12e9)
    assert plan_cost.model_state_bytes(1e9, 4, 1) == (2e9, 2e9, 3e9)
    assert plan_cost.model_state_bytes(1e9, 4, 2) == (2e9, 0.5e9, 3e9)
    assert plan_cost.model_state_bytes(1e9, 4, 3) == (0.5e9, 0.5e9, 3e9)
    with pytest.raises(PlanError) as err:
        plan_cost.model_state_bytes(1e9, 4, 4)
    assert err.value.field == "zero"


# GPT-3 175B's layer as in Korthikanti et al.: s=2048, b=1, h=12288, a=96, t=8; sbh = 25,165,824,
# 5as/h = 80.
@pytest.mark.parametrize(
    ("tp", "sp", "recompute", "expected"),
    [
        (1, False, Recompute.NONE, 2_868_903_936),  # sbh(34 + 80)
        (8, False, Recompute.NONE, 578_813_952),  # sbh(10 + 24/8 + 80/8)
        (8, True, Recompute.NONE, 358_612_992),  # sbh/8 · 114
        (1, False, Recompute.SELECTIVE, 855_638_016),  # sbh · 34
        (8, False, Recompute.SELECTIVE, 327_155_712),  # sbh(10 + 3)
        (8, True, Recompute.SELECTIVE, 106_954_752),  # sbh/8 · 34
        (8, False, Recompute.FULL, 50_331_648),  # 2sbh
        (8, True, Recompute.FULL, 6_291_456),  # 2sbh/8
    ],
)
def test_korthikanti_activation_per_layer(tp: int, sp: bool, recompute: Recompute, expected: int) -> None:
    got = plan_cost.activation_bytes_per_layer(
        2048, 1, 12288, 96, tp=tp, sequence_parallel=sp, recompute=recompute
    )
    assert got == pytest.approx(expected)


def test_activation_scales_with_micro_batch_and_in_flight_micro_batches() -> None:
    one = plan_cost.activation_bytes_per_layer(
        4096, 1, 8192, 64, tp=8, sequence_parallel=True, recompute=Recompute.NONE
    )
    two = plan_cost.activation_bytes_per_layer(
        4096, 2, 8192, 64, tp=8, sequence_parallel=True, recompute=Recompute.NONE
    )
    assert two == pytest.approx(2 * one)
    assert plan_cost.in_flight_micro_batches(pp=8, stage=0, m=128) == 8
    assert plan_cost.in_flight_micro_batches(pp=8, stage=7, m=128) == 1
    assert plan_cost.in_flight_micro_batches(pp=8, stage=0, m=3) == 3


def test_ring_collectives() -> None:
    assert plan_cost.ring_allreduce_bytes(8, 1e9) == pytest.approx(1.75e9)
    assert plan_cost.ring_allgather_bytes(8, 1e9) == pytest.approx(0.875e9)
    assert plan_cost.ring_allreduce_bytes(1, 1e9) == 0


@pytest.mark.parametrize(
    ("zero", "m", "per_mb", "per_step"),
    [
        (0, 4, 0.0, 3.5e9),  # 2(n-1)/n · 2 bytes · 1e9, n = 8
        (1, 4, 0.0, 3.5e9),
        (2, 4, 4 * 1.75e9, 1.75e9),
        (3, 1, 3 * 1.75e9, 0.0),  # 1.5× DDP, the ZeRO paper's figure
        (3, 4, 12 * 1.75e9, 0.0),
    ],
)
def test_dp_comm_bytes(zero: int, m: int, per_mb: float, per_step: float) -> None:
    got = plan_cost.dp_comm_bytes(1e9, dp=8, zero=zero, m=m)
    assert got == pytest.approx((per_mb, per_step))


def test_comm_volume_for_70b_tp8_pp8_dp8() -> None:
    """Hand-computed: a layer has 855,654,400 parameters, an sbh·2 activation is 67,108,864 bytes."""
    req = request()
    cfg = config(8, 8, 8, zero=1, recompute=Recompute.SELECTIVE, m=128)
    # last stage: 10 × (855,638,016/8 + 16,384) + 32000·8192/8 + 8192 parameters
    assert plan_cost.stage_params(LLAMA_70B, 8, 8, 7) == 1_102_487_552
    assert plan_cost.stage_params(LLAMA_70B, 8, 8, 0) == 1_102_479_360
    comm = plan_cost.comm_volume(req, cfg)
    assert comm.tp_bytes == pytest.approx(10 * 128 * 4 * 1.75 * 67_108_864)  # 601.3 GB
    assert comm.pp_bytes == pytest.approx(2 * 128 * 67_108_864 / 8)
    assert comm.dp_bytes == pytest.approx(3.5 * 1_102_487_552)
    assert (comm.tp_link, comm.pp_link, comm.dp_link) == ("intra", "inter", "inter")
    full = plan_cost.comm_volume(req, replace(cfg, recompute=Recompute.FULL))
    assert full.tp_bytes == pytest.approx(comm.tp_bytes * 6 / 4)


def test_model_flops_per_token() -> None:
    # 6 × (32 × 202,383,360 + 32000 × 4096) + 12 × 32 × 4096 × 2048
    assert plan_cost.model_flops_per_token(plan_spec.MODEL_PRESETS["llama-7b"], 2048) == 42_865_262_592
    model = plan_spec.MODEL_PRESETS["llama-7b"]
    assert plan_cost.recompute_flops_per_token(model, 2048, Recompute.NONE) == 0
    assert plan_cost.recompute_flops_per_token(model, 2048, Recompute.SELECTIVE) == 4 * 32 * 4096 * 2048
    assert (
        plan_cost.recompute_flops_per_token(model, 2048, Recompute.FULL)
        == 2 * 32 * 202_383_360 + 4 * 32 * 4096 * 2048
    )


def test_step_time_parts_and_bubble() -> None:
    req = request()
    cfg = config(8, 8, 8, zero=1, recompute=Recompute.SELECTIVE, m=128)
    t = plan_cost.step_time(req, cfg, plan_cost.comm_volume(req, cfg))
    assert plan_cost.pipeline_bubble_fraction(8, 128) == pytest.approx(7 / 128)
    slot = (t.compute_s + t.tp_comm_s + t.pp_comm_s) / 128
    assert t.bubble_s == pytest.approx(7 * slot)
    assert t.total_s == pytest.approx(t.compute_s + t.bubble_s + t.tp_comm_s + t.pp_comm_s + t.dp_exposed_s)
    # compute: 4M tokens × FLOPs/token over 512 GPUs at 50% of 312 TFLOP/s
    flops = 1024 * 4096 * (plan_cost.model_flops_per_token(LLAMA_70B, 4096) + 4 * 80 * 8192 * 4096)
    assert t.compute_s == pytest.approx(flops / 512 / (312e12 * 0.5))
    assert 0 < t.mfu < 0.5


@pytest.mark.parametrize(("zero", "hidden_behind"), [(2, 2 / 3), (3, 1.0)])
def test_dp_traffic_hides_behind_backward_or_whole_micro_batch(zero: int, hidden_behind: float) -> None:
    """ZeRO-2 reduce-scatters during backward (2/3 of a micro-batch); ZeRO-3 gathers span all of it."""
    req = request()
    cfg = config(8, 1, 64, zero=zero, recompute=Recompute.NONE, m=16)
    compute_mb = plan_cost.step_time(req, cfg, plan_cost.comm_volume(req, replace(cfg, dp=1))).compute_s / 16
    bandwidth = A100_80.inter_node_bw * req.link_efficiency
    traffic = plan_cost.CommVolume(
        0.0, 0.0, 16 * 0.9 * compute_mb * bandwidth, 0.0, "intra", "inter", "inter"
    )
    t = plan_cost.step_time(req, cfg, traffic)
    assert t.dp_comm_s == pytest.approx(16 * 0.9 * compute_mb)
    assert t.dp_exposed_s == pytest.approx(16 * max(0.0, 0.9 - hidden_behind) * compute_mb)


@pytest.mark.parametrize(
    ("text", "binary", "value"),
    [
        ("4M", True, 4 * 2**20),
        ("512k", True, 512 * 1024),
        ("70B", False, 70_000_000_000),
        ("1.5e9", False, 1_500_000_000),
        ("1024", True, 1024),
    ],
)
def test_parse_count(text: str, binary: bool, value: int) -> None:
    assert plan_spec.parse_count(text, field="x", binary=binary) == value


@pytest.mark.parametrize("text", ["0", "-4M", "four", "4X", ""])
def test_parse_count_refuses(text: str) -> None:
    with pytest.raises(PlanError) as err:
        plan_spec.parse_count(text, field="global_batch_tokens", binary=True)
    assert err.value.field == "global_batch_tokens"


def test_model_from_parameter_count_is_llama_shaped() -> None:
    model = plan_spec.resolve_model("7B")
    assert model.hidden == 4096 and model.heads == 32 and model.ffn == 11008
    assert model.layers % 4 == 0
    assert plan_spec.param_count(model) == pytest.approx(7e9, rel=0.1)
    assert plan_spec.resolve_model("70B", layers=80).layers == 80


# ----------------------------------------------------------------------------------------------- search


def test_70b_on_512_a100_finds_a_config_that_fits() -> None:
    result = P.plan(request())
    best = result.best
    cfg = best.config
    assert cfg.tp <= 8 and LLAMA_70B.heads % cfg.tp == 0 and LLAMA_70B.kv_heads % cfg.tp == 0
    assert LLAMA_70B.layers % cfg.pp == 0
    assert cfg.tp * cfg.pp * cfg.dp == 512
    assert cfg.micro_batches * cfg.dp * cfg.micro_batch == 1024
    assert best.memory.total <= 80 * GIB * 0.9
    # every alternative fits, is a different layout and is no faster than the best
    assert result.alternatives
    for alt in result.alternatives:
        assert alt.fits and alt.time.total_s >= best.time.total_s
        assert (alt.config.tp, alt.config.pp) != (cfg.tp, cfg.pp)
    reasons = {r.reason for r in result.rejected}
    assert {"tp_exceeds_node", "pp_layers", "memory"} <= reasons


@pytest.mark.parametrize(
    ("model", "tp", "pp", "dp", "reason"),
    [
        ("llama-7b", 16, 1, 32, "tp_exceeds_node"),  # 32 heads would divide, the node does not
        ("llama-13b", 3, 1, 64, "tp_heads"),  # 40 heads
        ("llama-70b", 16, 1, 32, "tp_exceeds_node"),
        ("llama-70b", 8, 32, 2, "pp_layers"),  # 80 layers
        ("llama-70b", 1, 1, 512, None),
    ],
)
def test_layout_rejection(model: str, tp: int, pp: int, dp: int, reason: str | None) -> None:
    rejection = P.layout_rejection(request(model=plan_spec.MODEL_PRESETS[model]), tp, pp, dp)
    assert (rejection.reason if rejection else None) == reason
    gqa = replace(LLAMA_70B, kv_heads=4)
    kv = P.layout_rejection(request(model=gqa), 8, 1, 64)
    assert kv is not None and kv.reason == "tp_kv_heads"
    odd_batch = P.layout_rejection(request(global_batch_seqs=1000), 1, 1, 512)
    assert odd_batch is not None and odd_batch.reason == "batch_dp"
    micro = P.layout_rejection(request(micro_batch=4), 8, 8, 8)  # 128 per rank: fine
    assert micro is None
    micro = P.layout_rejection(request(micro_batch=3), 8, 8, 8)
    assert micro is not None and micro.reason == "micro_batch"


def test_config_over_memory_is_rejected_with_the_reason() -> None:
    req = request()
    # pure data parallelism: every GPU holds all 69B parameters × 16 bytes
    cand = P.evaluate(req, config(1, 1, 512, zero=0, recompute=Recompute.FULL, m=2, sp=False))
    assert not cand.fits
    assert cand.memory.total >= 16 * 68_976_648_192
    result = P.plan(req)
    rejection = next(
        r for r in result.rejected if (r.tp, r.pp, r.dp, r.zero, r.recompute) == (1, 1, 512, 0, "full")
    )
    assert rejection.reason == "memory"
    assert rejection.needed_bytes == pytest.approx(cand.memory.total)
    assert f"needs {cand.memory.total / GIB:.1f} GiB > 72.0 GiB usable" == rejection.detail


def test_headroom_bounds_the_chosen_memory() -> None:
    roomy = P.plan(request(headroom=0.0)).best
    tight = P.plan(request(headroom=0.5)).best
    assert tight.memory.total <= 40 * GIB < roomy.memory.total


def test_recompute_only_when_memory_requires_it() -> None:
    # 7B on 64 H200: plenty of memory, so no recompute (it only adds FLOPs)
    result = P.plan(
        request(model=plan_spec.MODEL_PRESETS["llama-7b"], gpu=plan_spec.GPU_PRESETS["h200"], gpus=64)
    )
    assert result.best.config.recompute is Recompute.NONE
    assert result.best.activations_by_recompute["none"] > result.best.activations_by_recompute["selective"]


def test_nothing_fits_names_gpus_and_the_closest_miss() -> None:
    with pytest.raises(PlanError) as err:
        P.plan(request(gpus=8, gpu=plan_spec.GPU_PRESETS["a100-40gb"]))
    assert err.value.field == "gpus"
    assert "closest" in err.value.message and "GiB" in err.value.message


def test_no_runnable_layout() -> None:
    # 7 GPUs: tp=7 does not divide 64 heads, pp=7 does not divide 80 layers, 1024 sequences over dp=7
    with pytest.raises(PlanError) as err:
        P.plan(request(gpus=7))
    assert err.value.field == "gpus" and "no runnable layout" in err.value.message


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"gpus": 0}, "gpus"),
        ({"seq_len": -1}, "seq_len"),
        ({"micro_batch": 0}, "micro_batch"),
        ({"headroom": 1.0}, "headroom"),
        ({"mfu": 0.0}, "mfu"),
    ],
)
def test_request_validation(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(PlanError) as err:
        P.plan(request(**overrides))
    assert err.value.field == field


# ----------------------------------------------------------------------------------------------- CLI

runner = CliRunner()
BASE = ["--model", "llama-70b", "--gpus", "512", "--gpu-type", "A100-80GB", "--seq-len", "4096"]


def test_cli_json() -> None:
    result = runner.invoke(app, [*BASE, "--global-batch-tokens", "4M", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    best = data["best"]
    assert best["tp"] <= 8 and best["tp"] * best["pp"] * best["dp"] == 512
    assert best["memory_bytes"]["total"] <= best["memory_bytes"]["usable"]
    assert data["request"]["global_batch_seqs"] == 1024
    assert set(best["activations_bytes_by_recompute"]) == {"none", "selective", "full"}
    assert any(r["reason"] == "memory" for r in data["rejected"])


def test_cli_tables() -> None:
    result = runner.invoke(app, [*BASE, "--global-batch-seqs", "1024"])
    assert result.exit_code == 0, result.output
    for heading in ("Best:", "Memory per GPU", "Communication per GPU per step", "Alternatives", "Rejected"):
        assert heading in result.stdout


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (
            ["--model", "llama-70b", "--gpus", "0", "--seq-len", "4096", "--global-batch-tokens", "4M"],
            "--gpus",
        ),
        (
            ["--model", "llama-70b", "--gpus", "-8", "--seq-len", "4096", "--global-batch-tokens", "4M"],
            "--gpus",
        ),
        (
            ["--model", "llama-99b", "--gpus", "512", "--seq-len", "4096", "--global-batch-tokens", "4M"],
            "--model",
        ),
        (
            ["--model", "llama-70b", "--gpus", "512", "--seq-len", "0", "--global-batch-tokens", "4M"],
            "--seq-len",
        ),
        ([*BASE, "--global-batch-tokens", "4000000"], "--global-batch-tokens"),
        (BASE, "--global-batch-tokens"),
        ([*BASE[:4], "--gpu-type", "V100", "--seq-len", "4096", "--global-batch-tokens", "4M"], "--gpu-type"),
        (
            [*BASE[:4], "--gpu-type", "custom", "--seq-len", "4096", "--global-batch-tokens", "4M"],
            "--gpu-memory-gib",
        ),
        ([*BASE, "--global-batch-tokens", "4M", "--heads", "60"], "--heads"),
        ([*BASE, "--global-batch-tokens", "4M", "--headroom", "1.5"], "--headroom"),
        (
            [
                "--model",
                "llama-70b",
                "--gpus",
                "8",
                "--gpu-type",
                "A100-40GB",
                "--seq-len",
                "4096",
                "--global-batch-tokens",
                "4M",
            ],
            "--gpus",
        ),
    ],
)
def test_cli_bad_input_exits_2_naming_the_flag(args: list[str], flag: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert f"error: {flag}:" in result.stderr


def test_cli_custom_gpu() -> None:
    args = [
        "--model", "llama-7b", "--gpus", "16", "--gpu-type", "custom", "--gpu-memory-gib", "96",
        "--gpu-tflops", "500", "--intra-node-gbs", "400", "--inter-node-gbs", "50",
        "--seq-len", "2048", "--global-batch-seqs", "512", "--json",
    ]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["request"]["gpu"]["memory_bytes"] == 96 * GIB
    assert data["request"]["gpu"]["peak_flops"] == 500e12
