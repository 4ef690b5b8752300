"""Parent checkpoints: where every task but ``pretrain`` takes its weights and tokenizer from.

A parent is one of:

- a **Hugging Face directory** (what :mod:`export` writes): ``config.json`` of a
  ``LlamaForCausalLM``, ``model.safetensors`` (or an index and its shards), ``tokenizer.json``;
- a **Forge manifest**, ``<store>/checkpoints/<run>/step-<n>/manifest.json`` as a path or an
  object-store URL: every file is checked against the manifest's sha256, the manifest's meta
  carries the model config and the task, rank 0's shard the weights and the tokenizer.

:func:`check_parent` is what :func:`validation.validate` runs before any worker starts;
:func:`load_parent` is what each rank runs to build its model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from forge_kit.objectstore import ObjectStore
from forge_training.checkpoint import CheckpointError, CheckpointManager, Manifest

_MANIFEST = re.compile(r"(checkpoints/([^/]+)/step-(\d{8})/manifest\.json)$")
#: Tasks whose checkpoints hold a causal LM (a reward model's do not).
CAUSAL_TASKS = ("pretrain", "cpt", "sft", "dpo")


class ParentError(Exception):
    """A parent checkpoint that cannot be used; the message says why."""


@dataclass
class Parent:
    """A loaded parent: the causal LM, its config and its tokenizer (``tokenizer.json`` text)."""

    ref: str
    model: LlamaForCausalLM
    tokenizer_json: str

    @property
    def config(self) -> LlamaConfig:
        return self.model.config

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_str(self.tokenizer_json)


def _is_manifest(ref: str) -> bool:
    return ref.rstrip("/").endswith("manifest.json")


def _open_manifest(ref: str, tasks: tuple[str, ...] = CAUSAL_TASKS) -> tuple[CheckpointManager, Manifest]:
    match = _MANIFEST.search(ref)
    if match is None:
        raise ParentError(
            f"{ref!r} is not a Forge manifest path (.../checkpoints/<run>/step-<8 digits>/manifest.json)"
        )
    if "://" not in ref and not Path(ref).is_file():
        raise ParentError(f"{ref!r} does not exist")
    root = ref[: match.start(1)].rstrip("/") or "."
    manager = CheckpointManager(ObjectStore(root), match.group(2), async_save=False)
    try:
        manifest = manager.read_manifest(int(match.group(3)))
    except CheckpointError as exc:
        raise ParentError(f"{ref!r} is not a usable checkpoint: {exc}") from None
    task = manifest.meta.get("task", "pretrain")
    if task not in tasks:
        what = "a causal language model" if tasks == CAUSAL_TASKS else f"one of {', '.join(tasks)}"
        raise ParentError(f"{ref!r} is a {task!r} checkpoint, not {what}")
    if not isinstance(manifest.meta.get("model_config"), dict):
        raise ParentError(f"{ref!r} carries no model_config in its meta (written by an older Forge)")
    return manager, manifest


def _weight_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ParentError(f"{index}: unreadable index ({exc})") from None
        return [root / name for name in sorted(set(weight_map.values()))]
    single = root / "model.safetensors"
    if not single.is_file():
        raise ParentError(f"{root} has no model.safetensors")
    return [single]


def _check_hf(ref: str) -> dict[str, Any]:
    root = Path(ref)
    if not root.is_dir():
        raise ParentError(f"{ref!r} does not exist (neither a Hugging Face directory nor a manifest.json)")
    try:
        config: dict[str, Any] = json.loads((root / "config.json").read_text())
    except FileNotFoundError:
        raise ParentError(f"{root} has no config.json") from None
    except ValueError as exc:
        raise ParentError(f"{root}/config.json: unreadable ({exc})") from None
    architectures = config.get("architectures") or ["LlamaForCausalLM"]
    if config.get("model_type") != "llama" or "LlamaForCausalLM" not in architectures:
        raise ParentError(
            f"{root} holds a {config.get('model_type')!r} {architectures} model, not a LlamaForCausalLM"
        )
    for path in _weight_files(root):
        try:
            with safe_open(str(path), "pt") as handle:
                if not list(handle.keys()):
                    raise ParentError(f"{path}: no tensors")
        except ParentError:
            raise
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise ParentError(f"{path}: corrupt weights ({exc})") from None
    try:
        Tokenizer.from_file(str(root / "tokenizer.json"))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception
        raise ParentError(f"{root}/tokenizer.json: missing or unreadable ({exc})") from None
    return config


def check_parent(ref: str) -> None:
    """Raise :class:`ParentError` unless ``ref`` is a complete causal-LM checkpoint with a tokenizer."""
    if _is_manifest(ref):
        _open_manifest(ref)
    else:
        _check_hf(ref)


def load_parent(ref: str) -> Parent:
    """The parent's model (float32, train mode) and tokenizer."""
    if _is_manifest(ref):
        manager, manifest = _open_manifest(ref)
        shard = manager.load_shard(manifest, 0)
        if not isinstance(shard.get("tokenizer"), str):
            raise ParentError(f"{ref!r}: rank 0's shard holds no tokenizer")
        model = LlamaForCausalLM(LlamaConfig.from_dict(manifest.meta["model_config"]))
        model.load_state_dict(shard["model"])
        return Parent(ref, model, shard["tokenizer"])
    _check_hf(ref)
    root = Path(ref)
    model = LlamaForCausalLM.from_pretrained(root, dtype="float32")
    model.train()
    return Parent(ref, model, (root / "tokenizer.json").read_text(encoding="utf-8"))
