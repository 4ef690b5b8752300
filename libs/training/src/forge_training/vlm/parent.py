"""VLM parents: where stages 2 and 3 of the curriculum take their weights from.

A VLM parent is an exported folder (:func:`model.export_vlm`: ``config.json`` of a
``LlavaForConditionalGeneration``, safetensors, ``tokenizer.json``, ``preprocessor_config.json``)
or a Forge manifest of a ``vlm`` run (``.../checkpoints/<run>/step-<n>/manifest.json``, path or
object-store URL, files checked against their sha256). Stage 1 and joint training start from a
causal-LM parent instead (:mod:`forge_training.parents`).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer
from transformers import LlavaConfig, LlavaForConditionalGeneration

from forge_training.parents import ParentError, _is_manifest, _open_manifest, _weight_files
from forge_training.vlm.model import IMAGE_TOKEN, LoadedVlm, image_spec, load_vlm

VLM_TASKS = ("vlm",)


def _check_folder(root: Path) -> None:
    if not root.is_dir():
        raise ParentError(f"{str(root)!r} does not exist (neither a VLM folder nor a manifest.json)")
    try:
        config = json.loads((root / "config.json").read_text())
    except FileNotFoundError:
        raise ParentError(f"{root} has no config.json") from None
    except ValueError as exc:
        raise ParentError(f"{root}/config.json: unreadable ({exc})") from None
    if "LlavaForConditionalGeneration" not in (config.get("architectures") or []):
        raise ParentError(
            f"{root} holds a {config.get('architectures')} model, not a LlavaForConditionalGeneration"
        )
    _weight_files(root)
    for name in ("tokenizer.json", "preprocessor_config.json"):
        if not (root / name).is_file():
            raise ParentError(f"{root} has no {name}")


def check_vlm_parent(ref: str) -> None:
    """Raise :class:`ParentError` unless ``ref`` is a usable VLM checkpoint."""
    if _is_manifest(ref):
        _open_manifest(ref, VLM_TASKS)
    else:
        _check_folder(Path(ref))


def load_vlm_parent(ref: str) -> LoadedVlm:
    """The parent VLM (float32, train mode), its tokenizer and image spec."""
    if _is_manifest(ref):
        manager, manifest = _open_manifest(ref, VLM_TASKS)
        shard = manager.load_shard(manifest, 0)
        if not isinstance(shard.get("tokenizer"), str):
            raise ParentError(f"{ref!r}: rank 0's shard holds no tokenizer")
        model = LlavaForConditionalGeneration(LlavaConfig.from_dict(manifest.meta["model_config"]))
        model.load_state_dict(shard["model"])
        tokenizer = Tokenizer.from_str(shard["tokenizer"])
        loaded = LoadedVlm(model, tokenizer, image_spec(model))
    else:
        _check_folder(Path(ref))
        try:
            loaded = load_vlm(Path(ref))
        except (OSError, ValueError) as exc:
            raise ParentError(f"{ref!r}: {exc}") from None
    if loaded.tokenizer.token_to_id(IMAGE_TOKEN) != loaded.image_token_id:
        raise ParentError(f"{ref!r}: the tokenizer's {IMAGE_TOKEN} is not config.image_token_id")
    loaded.model.train()
    return loaded
