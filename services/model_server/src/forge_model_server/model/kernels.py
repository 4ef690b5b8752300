"""Native CPU kernels of the forward pass, compiled on first use with torch's extension builder.

``csrc/paged_attention.cpp`` holds the decode attention over the paged KV cache in one pass
(``torch.ops.forge.paged_decode_attention``; its header describes the arguments). It is built by
``torch.utils.cpp_extension.load`` (a C++ compiler and ninja) into :func:`build_directory`, under a
name made of the vector width torch itself dispatches to on this CPU and a digest of the source,
flags and torch version: a cache shared by machines of different kinds never hands AVX-512 code to
a CPU without it, and an edited source is built afresh.

Where it cannot be built (no compiler, no ninja), :func:`paged_decode_attention` raises
:class:`KernelUnavailableError` naming why, and the model falls back to torch's batched matmuls
when the setting allows it (``decode_attention="auto"``).

:class:`Linear` is the projections' matmul: oneDNN's inner product on a weight reordered once, at
load, into its blocked layout (what vLLM's CPU backend does), where torch has oneDNN (for bfloat16
weights: where the CPU has oneDNN's bf16 path); ``F.linear`` elsewhere. On a Llama's projections it took 15-30% less time than ``F.linear`` (MKL's sgemm),
from a decode step's 32 rows to a prefill's 512; MKL's own packed sgemm took as long as
``F.linear`` (``load/inference/RESULTS.md``).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import structlog
import torch
import torch.nn.functional as F

log = structlog.get_logger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"

# Compiler flags per torch CPU capability (``torch.backends.cpu.get_cpu_capability()``).
_ARCH_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
    "DEFAULT": [],
}

PagedDecodeAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], None
]


class Linear:
    """``x @ weight.T + bias`` with the weight packed once for oneDNN (see the module docstring);
    the same arithmetic up to the order of float additions (a few ulps)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features = int(weight.shape[0])
        self.bias = bias
        self._packed: torch.Tensor | None = None
        self.weight: torch.Tensor | None = weight
        if _packable(weight.dtype):
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
            self.weight = None  # the packed copy is all a call reads

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is None:
            return F.linear(x, self.weight, self.bias)  # type: ignore[arg-type]
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return out


def _packable(dtype: torch.dtype) -> bool:
    """Whether oneDNN takes a weight of ``dtype`` here: float32 wherever torch has oneDNN,
    bfloat16 only on CPUs with its bf16 path (AVX-512 BW/VL/DQ or AVX-NE-CONVERT)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


class KernelUnavailableError(RuntimeError):
    """The native kernel cannot be built or loaded here; the message says why."""


_lock = threading.Lock()
_loaded: PagedDecodeAttention | None = None
_failure: str | None = None


def paged_decode_attention() -> PagedDecodeAttention:
    """``torch.ops.forge.paged_decode_attention``, built on the first call of the process.

    Raises :class:`KernelUnavailableError` (every call, with the first failure's reason) when it
    cannot be built.
    """
    global _loaded, _failure
    with _lock:
        if _loaded is None and _failure is None:
            try:
                _loaded = _build()
            except KernelUnavailableError as exc:
                _failure = str(exc)
        if _loaded is None:
            raise KernelUnavailableError(_failure)
        return _loaded


def build_directory() -> Path:
    """Where the kernels are built: ``$TORCH_EXTENSIONS_DIR/forge``, else under ``~/.cache``."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "torch_extensions")
    return Path(root) / "forge"


def _build() -> PagedDecodeAttention:
    """Load the library built for this source, torch and CPU kind, building it first if needed.

    Each build runs in a folder of its own and its library is then renamed into place, so a
    finished library is all a later process looks for: concurrent first uses each build (the same
    bytes; the last rename wins), a process killed mid-build leaves no lock for others to wait on,
    and an image that built the kernel needs no compiler at run time.
    """
    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-fopenmp", *_ARCH_FLAGS.get(capability, [])]
    recipe = SOURCE.read_bytes() + " ".join([torch.__version__, *flags]).encode()
    name = f"forge_paged_attention_{capability.lower()}_{hashlib.sha256(recipe).hexdigest()[:12]}"
    root = build_directory()
    library = root / f"{name}.so"
    try:
        if library.is_file():
            torch.ops.load_library(str(library))
        else:
            from torch.utils import cpp_extension

            root.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix=f".{name}-", dir=root) as scratch:
                cpp_extension.load(  # builds, then loads the library from the scratch folder
                    name=name,
                    sources=[str(SOURCE)],
                    extra_cflags=flags,
                    extra_ldflags=["-fopenmp"],
                    build_directory=scratch,
                    is_python_module=False,
                    verbose=False,
                )
                os.replace(Path(scratch) / f"{name}.so", library)
    except (RuntimeError, OSError) as exc:  # no compiler or ninja, compile or link errors
        raise KernelUnavailableError(f"building {name} in {root} failed: {exc}") from exc
    log.info("kernel.loaded", kernel=name)
    op: PagedDecodeAttention = torch.ops.forge.paged_decode_attention
    return op
