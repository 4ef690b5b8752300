"""Mixed precision and the model's kernels: what the recipe's ``precision``, ``compile`` and
``activation_checkpointing`` keys do to a run.

``precision`` (:class:`Amp`):

- ``fp32`` (the default): no autocast, no loss scaling; the run is what it always was.
- ``bf16``: forward passes (training and evaluation) under ``torch.autocast(dtype=bfloat16)``;
  the parameters, their gradients, the AdamW state and every reduction (loss sums, gradient
  all-reduce / reduce-scatter, the clipping norm) stay fp32: the master weights are the model's
  own. bf16 has fp32's exponent range, so no loss scaling (nanoGPT, torchtitan). Works on CPUs too.
- ``fp16``: the same autocast with float16, and a :class:`torch.amp.GradScaler`: the loss is
  scaled up before ``backward`` so small gradients do not flush to zero, the gradients are
  unscaled before clipping, and a step whose gradients overflowed is skipped (the scale halves).
  Refused under ``fsdp`` (FSDP2's sharded gradients need a sharded scaler; torchtitan offers bf16
  only).

``activation_checkpointing``: every transformer block recomputes its activations in the backward
pass instead of keeping them (the non-reentrant ``torch.utils.checkpoint`` through transformers'
``activation_checkpointing_enable``): less activation memory for about a third more compute.

``compile``: ``torch.compile`` on each transformer block (torchtitan's per-block regional
compilation: one compiled graph reused by every block, a short compile, and the FSDP units
stay the blocks). Applied after activation checkpointing and before sharding, in torchtitan's order.

The attention kernel: every model is built with ``attn_implementation="sdpa"``
(:func:`torch.nn.functional.scaled_dot_product_attention`: FlashAttention or memory-efficient
kernels on a GPU, a fused CPU kernel otherwise); transformers' default for these models, checked by
:func:`attention_kernel`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from transformers import PreTrainedModel

from forge_training import parallel
from forge_training.schema import PRECISIONS

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Amp:
    """The autocast context and the optional loss scaler of one run on ``device``."""

    def __init__(self, precision: str, device: torch.device) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision: must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        self.precision = precision
        self.device = device
        self.dtype = _DTYPES.get(precision)
        self.scaler: torch.amp.GradScaler | None = (
            torch.amp.GradScaler(device.type) if precision == "fp16" else None
        )

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Forward passes under autocast (nothing for ``fp32``)."""
        if self.dtype is None:
            yield
            return
        with torch.autocast(self.device.type, dtype=self.dtype):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled first under ``fp16``."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the loss scale (before clipping); nothing without a scaler."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()``; under ``fp16`` skipped when the gradients overflowed, and the
        scale updated."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def attention_kernel(model: PreTrainedModel) -> str:
    """The attention implementation ``model`` runs (``sdpa`` for every model Forge builds)."""
    return str(getattr(model.config, "_attn_implementation", None) or "eager")


def prepare_kernels(model: PreTrainedModel, activation_checkpointing: bool, compile_blocks: bool) -> None:
    """Activation checkpointing, then ``torch.compile`` per transformer block (see the module
    docstring); in place, before the model is sharded or wrapped."""
    if activation_checkpointing:
        if not model.supports_gradient_checkpointing:
            raise ValueError(f"activation_checkpointing: {type(model).__name__} does not support it")
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if compile_blocks:
        for block in parallel.transformer_blocks(model):
            block.compile()
