"""A LLaVA checkpoint's vision side: its image preprocessing, vision tower and projector.

A vision-language checkpoint is the folder ``LlavaForConditionalGeneration.save_pretrained``
writes (``model_type: llava``): a vision tower (CLIP-style ViT), an MLP ``multi_modal_projector``
into the language model's embedding space, and a Llama language model; plus the tokenizer, whose
``<image>`` token is ``config.image_token_id``, and ``preprocessor_config.json``, the Hugging Face
image processor that turns an image into the tower's pixel values (what vLLM's LLaVA loader reads).

:func:`load_llava` splits it: the language model goes to the paged engine (:class:`LlamaModel`,
weights renamed to a Llama's), the tower and the projector stay transformers modules here
(:class:`VisionEncoder`), run by the engine on a step's new images, all of them in one batch.
Each image becomes ``image_seq_length`` embeddings, which replace the placeholder tokens of the
prompt (LLaVA's "default" feature selection drops the tower's CLS position).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from forge_model_server.model.llama import DecodeAttention, LlamaConfig, LlamaModel, UnsupportedModelError

PREPROCESSOR_FILE = "preprocessor_config.json"
#: Weight-name prefixes of the three parts, as transformers 4.x/5.x save them (either layout).
_LANGUAGE = (("language_model.model.", "model."), ("model.language_model.", "model."))
_LM_HEAD = ("language_model.lm_head.weight", "lm_head.weight")
#: The tower as published LLaVA checkpoints name it (a ``CLIPVisionModel``: ``vision_model.…``)
#: or as transformers 5 writes it (the bare transformer); the longer prefixes are tried first.
_TOWER = (
    "vision_tower.vision_model.",
    "model.vision_tower.vision_model.",
    "vision_tower.",
    "model.vision_tower.",
)
_PROJECTOR = ("multi_modal_projector.", "model.multi_modal_projector.")


def is_llava(config: dict[str, Any]) -> bool:
    return config.get("model_type") == "llava"


@dataclass(frozen=True)
class ImageLayout:
    """How a prompt holds an image: the placeholder token and how many of them one image fills."""

    image_token_id: int
    image_seq_length: int


class VisionEncoder:
    """Preprocesses images as the checkpoint says and encodes them into language-model embeddings."""

    def __init__(
        self,
        config: Any,
        tower: torch.nn.Module,
        projector: torch.nn.Module,
        processor: Any,
        layout: ImageLayout,
    ) -> None:
        self._config = config
        self._tower = tower.eval()
        self._projector = projector.eval()
        self._processor = processor
        self.layout = layout

    def preprocess(self, image: Any) -> torch.Tensor:
        """One RGB ``PIL.Image`` → the tower's pixel values ``[channels, height, width]``."""
        pixels = self._processor(images=[image], return_tensors="pt")["pixel_values"]
        return pixels[0].to(torch.float32)

    @torch.inference_mode()
    def encode(self, pixel_values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Images' pixel values → each image's ``[image_seq_length, hidden]`` embeddings, in one
        batched pass of the tower and the projector (transformers' ``get_image_features``)."""
        batch = torch.stack(pixel_values)
        out = self._tower(batch, output_hidden_states=True, return_dict=True)
        layer = self._config.vision_feature_layer
        layers = [layer] if isinstance(layer, int) else list(layer)
        states = [out.hidden_states[i] for i in layers]
        if self._config.vision_feature_select_strategy == "default":
            states = [s[:, 1:] for s in states]
        features = self._projector(torch.cat(states, dim=-1))
        if features.shape[1] != self.layout.image_seq_length:
            raise UnsupportedModelError(
                f"the vision tower gives {features.shape[1]} positions per image; "
                f"config.image_seq_length is {self.layout.image_seq_length}"
            )
        return list(features.to(torch.float32))


def _split(weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], ...]:
    language: dict[str, torch.Tensor] = {}
    tower: dict[str, torch.Tensor] = {}
    projector: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name in _LM_HEAD:
            language["lm_head.weight"] = tensor
        elif (lm := next((p for p in _LANGUAGE if name.startswith(p[0])), None)) is not None:
            language[lm[1] + name[len(lm[0]) :]] = tensor
        elif (t := next((p for p in _TOWER if name.startswith(p)), None)) is not None:
            tower[name[len(t) :]] = tensor
        elif (p := next((p for p in _PROJECTOR if name.startswith(p)), None)) is not None:
            projector[name[len(p) :]] = tensor
        else:
            raise UnsupportedModelError(f"unexpected weight in a LLaVA checkpoint: {name}")
    return language, tower, projector


def load_llava(
    folder: Path, *, num_blocks: int, block_size: int, decode_attention: DecodeAttention = "auto"
) -> tuple[LlamaModel, VisionEncoder]:
    """The language model (paged) and the vision encoder of a LLaVA folder; a part that is missing
    or not supported is an :class:`UnsupportedModelError` naming it."""
    from transformers import AutoImageProcessor, AutoModel, LlavaConfig
    from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

    raw = json.loads((folder / "config.json").read_text())
    if not (folder / PREPROCESSOR_FILE).is_file():
        raise UnsupportedModelError(
            f"a LLaVA checkpoint needs {PREPROCESSOR_FILE} (how images are resized and normalised)"
        )
    config = LlavaConfig.from_pretrained(str(folder))
    text = raw.get("text_config") or {}
    llama_config = LlamaConfig.from_json(text)
    weights: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(str(path)))
    language, tower_weights, projector_weights = _split(weights)
    llama = LlamaModel(
        llama_config,
        language,
        num_blocks=num_blocks,
        block_size=block_size,
        decode_attention=decode_attention,
    )
    tower = AutoModel.from_config(config.vision_config)
    projector = LlavaMultiModalProjector(config)
    for module, state, what in (
        (tower, tower_weights, "vision tower"),
        (projector, projector_weights, "projector"),
    ):
        missing, unexpected = module.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise UnsupportedModelError(
                f"the {what} weights do not match its config (missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
    processor = AutoImageProcessor.from_pretrained(str(folder))
    layout = ImageLayout(int(config.image_token_id), int(config.image_seq_length))
    return llama, VisionEncoder(config, tower.float(), projector.float(), processor, layout)
