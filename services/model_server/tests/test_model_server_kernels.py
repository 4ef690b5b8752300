"""The native decode-attention kernel: the same output as attention on the gathered context, its
checks on bad arguments, the model's fallback to torch, and an image-style build (built once with
a compiler, loaded later without one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from forge_model_server.engine.async_engine import HFEngineLoader
from forge_model_server.engine.core import EngineConfig
from forge_model_server.model import kernels, llama
from forge_model_server.model.kernels import KernelUnavailableError, paged_decode_attention
from forge_model_server.model.llama import LlamaModel
from forge_model_server.service import ModelInfo, ModelNotLoadedError


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor
) -> torch.Tensor:
    """Each sequence's context gathered from its blocks, then plain SDPA (GQA by repeating heads)."""
    _, kv, bs, dim = k.shape
    out = torch.empty_like(q)
    for s, ctx in enumerate(lens.tolist()):
        blocks = tables[s, : -(-ctx // bs)].long()
        keys = k[blocks].transpose(0, 1).reshape(kv, -1, dim)[:, :ctx]
        values = v[blocks].transpose(0, 1).reshape(kv, -1, dim)[:, :ctx]
        groups = q.shape[1] // kv
        keys, values = keys.repeat_interleave(groups, 0), values.repeat_interleave(groups, 0)
        out[s] = F.scaled_dot_product_attention(q[s][:, None], keys, values).squeeze(1)
    return out


def random_case(
    heads: int, kv: int, dim: int, bs: int, lens: list[int], seed: int = 0, *, shared: bool = False
) -> tuple[torch.Tensor, ...]:
    """Caches of 64 blocks, each sequence on blocks scattered over the pool; with ``shared`` every
    sequence starts on the first one's blocks (the prefix cache's case)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(64, kv, bs, dim, generator=gen)
    v = torch.randn(64, kv, bs, dim, generator=gen)
    q = torch.randn(len(lens), heads, dim, generator=gen) * 2
    free = torch.randperm(64, generator=gen).tolist()
    width = max(-(-n // bs) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for s, n in enumerate(lens):
        for b in range(-(-n // bs)):
            tables[s, b] = tables[0, b] if shared and s > 0 and b < -(-lens[0] // bs) - 1 else free.pop()
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize(
    ("heads", "kv", "dim", "bs"),
    [(4, 4, 64, 16), (8, 2, 128, 16), (6, 3, 48, 5), (2, 1, 16, 4)],
    ids=["mha-64", "gqa-128", "gqa-48-odd-blocks", "gqa-16"],
)
def test_kernel_matches_attention_on_the_gathered_context(heads: int, kv: int, dim: int, bs: int) -> None:
    """Contexts of one token, exactly full blocks and partial last blocks; head sizes with a fixed
    fast path (64, 128) and without one."""
    lens = [1, bs, 3 * bs, 2 * bs + 1, 7 * bs - 2]
    q, k, v, tables, ctx = random_case(heads, kv, dim, bs, lens)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention()(out, q, k, v, tables, ctx, dim**-0.5)
    torch.testing.assert_close(out, reference(q, k, v, tables, ctx), rtol=1e-5, atol=1e-5)


def test_kernel_reads_blocks_shared_by_several_sequences() -> None:
    lens = [40, 45, 37]
    q, k, v, tables, ctx = random_case(4, 2, 64, 8, lens, seed=3, shared=True)
    assert tables[1, 0] == tables[0, 0] and tables[2, 3] == tables[0, 3]
    out = torch.empty_like(q)
    paged_decode_attention()(out, q, k, v, tables, ctx, 64**-0.5)
    torch.testing.assert_close(out, reference(q, k, v, tables, ctx), rtol=1e-5, atol=1e-5)


def test_kernel_output_does_not_depend_on_the_thread_count() -> None:
    q, k, v, tables, ctx = random_case(4, 4, 64, 16, [200, 17, 90, 301, 5, 64], seed=5)
    outs = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = torch.empty_like(q)
            paged_decode_attention()(out, q, k, v, tables, ctx, 0.125)
            outs.append(out)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda a: {**a, "k": a["k"].double()}, "float32"),
        (lambda a: {**a, "q": a["q"].transpose(0, 1).contiguous().transpose(0, 1)}, "contiguous"),
        (lambda a: {**a, "tables": a["tables"].long()}, "int32"),
        (lambda a: {**a, "lens": torch.tensor([0, 16], dtype=torch.int32)}, "context length 0"),
        (lambda a: {**a, "lens": torch.tensor([16, 999], dtype=torch.int32)}, "does not fit"),
        (lambda a: {**a, "tables": a["tables"].index_fill(1, torch.tensor([0]), 64)}, "outside the pool"),
        (lambda a: {**a, "q": a["q"][:, :3].contiguous(), "out": a["out"][:, :3].contiguous()}, "multiple"),
    ],
    ids=["dtype", "strides", "table-dtype", "empty-context", "long-context", "bad-block", "heads"],
)
def test_kernel_refuses_bad_arguments_by_name(mutate: object, message: str) -> None:
    q, k, v, tables, ctx = random_case(4, 2, 64, 16, [16, 20])
    args = {"out": torch.empty_like(q), "q": q, "k": k, "v": v, "tables": tables, "lens": ctx}
    a = mutate(args)  # type: ignore[operator]
    with pytest.raises(RuntimeError, match=message):
        paged_decode_attention()(a["out"], a["q"], a["k"], a["v"], a["tables"], a["lens"], 1.0)


@pytest.fixture
def kernel_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model finds no kernel, as on a host without a compiler."""

    def missing() -> kernels.PagedDecodeAttention:
        raise KernelUnavailableError("no C++ compiler here")

    monkeypatch.setattr(llama, "paged_decode_attention", missing)


@pytest.mark.usefixtures("kernel_missing")
def test_auto_falls_back_to_torch_and_native_refuses_where_the_kernel_is_missing(tiny_llama: Path) -> None:
    fallback = LlamaModel.load(tiny_llama, num_blocks=8, block_size=4, decode_attention="auto")
    assert fallback.decode_attention == "torch"
    with pytest.raises(KernelUnavailableError, match="no C\\+\\+ compiler"):
        LlamaModel.load(tiny_llama, num_blocks=8, block_size=4, decode_attention="native")


@pytest.mark.usefixtures("kernel_missing")
def test_a_server_set_to_native_names_the_missing_kernel_when_loading_a_model(tiny_llama: Path) -> None:
    loader = HFEngineLoader(
        EngineConfig(num_blocks=8, block_size=4), max_waiting=4, decode_attention="native"
    )
    info = ModelInfo("tiny", "1", str(tiny_llama), 0, 256, ("model.safetensors",))
    with pytest.raises(ModelNotLoadedError, match="no C\\+\\+ compiler here"):
        loader(info)


def test_native_is_float32_only(tiny_llama: Path) -> None:
    assert (
        LlamaModel.load(tiny_llama, num_blocks=8, block_size=4, decode_attention="torch").decode_attention
        == "torch"
    )
    config = llama.LlamaConfig.from_json(json.loads((tiny_llama / "config.json").read_text()))
    tensors = load_file(str(next(tiny_llama.glob("*.safetensors"))))
    with pytest.raises(KernelUnavailableError, match="float32 only"):
        LlamaModel(
            config, tensors, num_blocks=8, block_size=4, dtype=torch.bfloat16, decode_attention="native"
        )
    assert (
        LlamaModel(config, tensors, num_blocks=8, block_size=4, dtype=torch.bfloat16).decode_attention
        == "torch"
    )


LOAD = "from forge_model_server.model.kernels import paged_decode_attention; print(paged_decode_attention())"


def test_a_built_kernel_loads_without_a_compiler_and_a_missing_one_is_named(tmp_path: Path) -> None:
    """What an image does: build where a compiler is (here two processes at once, as two model
    servers starting together would), then load the build where none is."""
    bare_path = str(Path(sys.executable).parent)  # the venv's bin: python and ninja, no c++
    ext = tmp_path / "ext"
    no_compiler = {"HOME": str(tmp_path), "PATH": bare_path, "TORCH_EXTENSIONS_DIR": str(ext)}
    failed = subprocess.run([sys.executable, "-c", LOAD], env=no_compiler, capture_output=True, text=True)
    assert failed.returncode != 0
    assert "KernelUnavailableError" in failed.stderr and "failed" in failed.stderr
    with_compiler = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext)}
    builders = [
        subprocess.Popen([sys.executable, "-c", LOAD], env=with_compiler, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    for builder in builders:
        assert builder.wait(timeout=240) == 0, builder.stderr.read() if builder.stderr else ""
    assert [p.suffix for p in (ext / "forge").iterdir()] == [".so"]  # no scratch folder left behind
    loaded = subprocess.run([sys.executable, "-c", LOAD], env=no_compiler, capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr
    assert "forge.paged_decode_attention" in loaded.stdout


@pytest.mark.parametrize("rows", [1, 32, 513])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_gives_f_linear_up_to_rounding(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(rows, 128, generator=gen)[:, ::2]  # a strided view, as a fused output's slice is
    linear = kernels.Linear(weight, bias)
    assert (linear.weight is None) == torch.backends.mkldnn.is_available()  # packed where oneDNN is
    torch.testing.assert_close(linear(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_linear_of_a_dtype_onednn_does_not_pack_is_f_linear() -> None:
    weight, x = torch.randn(8, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    linear = kernels.Linear(weight, None)
    assert linear.weight is weight
    assert torch.equal(linear(x), F.linear(x, weight))


def test_bfloat16_linear_works_with_or_without_onednn_bf16() -> None:
    """A CPU without oneDNN's bf16 path (AVX2 only) refuses to pack a bf16 weight: Linear then
    keeps it for ``F.linear``; where the path exists it packs. Same result either way."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(32, 16, generator=gen).to(torch.bfloat16)
    x = torch.randn(5, 16, generator=gen).to(torch.bfloat16)
    linear = kernels.Linear(weight, None)
    packs = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert (linear.weight is None) == packs
    torch.testing.assert_close(linear(x), F.linear(x, weight), rtol=2e-2, atol=2e-2)
