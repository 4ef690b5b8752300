"""The vision-language model: transformers' ``LlavaForConditionalGeneration`` = a
``CLIPVisionModel`` tower (patch embedding + ViT), its two-layer MLP ``multi_modal_projector``,
and a Llama language model, built from a Forge causal-LM parent; its tokenizer (the parent's
with ``<image>`` added; the tower's position table initialised with fixed 2-D sin-cos), chat template, export and loading.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    PreTrainedModel,
)

from forge_training.data import EOT
from forge_training.export import hf_tokenizer
from forge_training.vlm.images import ImageSpec

IMAGE_TOKEN = "<image>"

#: The chat template stored in the exported tokenizer and processor. A message's content is a
#: string or a list of parts; an image part (``{"type": "image"}`` or ``{"type": "image_url"}``)
#: renders as ``<image>``, a text part as its text, parts joined with nothing between them.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['content'] is string %}{% set body = m['content'] %}"
    "{% else %}{% set ns = namespace(body='') %}"
    "{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{% set ns.body = ns.body + p['text'] %}"
    "{% else %}{% set ns.body = ns.body + '<image>' %}{% endif %}"
    "{% endfor %}{% set body = ns.body %}{% endif %}"
    "{% if m['role'] == 'user' %}{{ 'User: ' + body + '\\n' }}"
    "{% else %}{{ 'Assistant: ' + body + eos_token + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def content_text(content: object) -> str:
    """A message's content as the template renders it (image parts as ``<image>``)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"message content must be a string or a list of parts, got {type(content).__name__}")
    out = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("text", "image", "image_url"):
            raise ValueError(f"unknown content part {part!r}")
        out.append(str(part.get("text", "")) if part["type"] == "text" else IMAGE_TOKEN)
    return "".join(out)


def render_chat(messages: list[dict[str, object]], add_generation_prompt: bool = False) -> str:
    """:data:`CHAT_TEMPLATE` in Python (tested equal to the Jinja copy)."""
    out = []
    for m in messages:
        body = content_text(m["content"])
        out.append(f"User: {body}\n" if m["role"] == "user" else f"Assistant: {body}{EOT}\n")
    if add_generation_prompt:
        out.append("Assistant:")
    return "".join(out)


@dataclass(frozen=True)
class VisionShape:
    """The vision tower's shape (a ``CLIPVisionConfig``)."""

    image_size: int = 32
    patch_size: int = 16
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 2

    def config(self) -> CLIPVisionConfig:
        return CLIPVisionConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            image_size=self.image_size,
            patch_size=self.patch_size,
            projection_dim=self.hidden_size,
        )

    @property
    def image_seq_length(self) -> int:
        """Tokens per image: one per patch (the ``default`` strategy drops CLS)."""
        return (self.image_size // self.patch_size) ** 2


def sincos_positions(grid: int, dim: int) -> torch.Tensor:
    """The fixed 2-D sin-cos position table of ViT/MAE for a ``grid`` x ``grid`` patch grid,
    ``[grid * grid, dim]`` in raster order (half the channels encode the row, half the column; each
    half sin and cos of ``position * pi * 10000^(-k/F)``). Coordinates are in units of pi so that the
    cells of a small grid (4 x 4 here) differ in the fastest channels by a vector of about the norm
    of a patch embedding; with MAE's integer coordinates they would barely differ."""
    if dim % 4:
        raise ValueError(f"the vision hidden size must be a multiple of 4 for 2-D sin-cos, got {dim}")
    freqs = dim // 4
    omega = math.pi * 10000.0 ** (-torch.arange(freqs, dtype=torch.float64) / freqs)
    rows, cols = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")

    def axis(pos: torch.Tensor) -> torch.Tensor:
        angles = pos.reshape(-1, 1).double() * omega[None]
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    return torch.cat([axis(rows), axis(cols)], dim=1).float()


def init_vision_positions(model: LlavaForConditionalGeneration) -> None:
    """Set the vision tower's patch position embeddings to :func:`sincos_positions` (the class
    token's row to zero). CLIP's own init draws the table with std 0.02 (norm ~0.15 a patch)
    against patch embeddings of norm ~5 for a normalised image, so a fresh tower (frozen in
    stage 1; no pre-trained CLIP here) hands the LM patches that hardly say where they are; a
    pre-trained CLIP's table is as large as its patch embeddings. Used for every fresh VLM."""
    embeddings = model.model.vision_tower.embeddings
    table = embeddings.position_embedding.weight
    grid = round(math.sqrt(table.size(0) - 1))
    with torch.no_grad():
        table[0].zero_()
        table[1:].copy_(sincos_positions(grid, table.size(1)))


def with_image_token(tokenizer: Tokenizer) -> tuple[Tokenizer, int]:
    """A copy of ``tokenizer`` with ``<image>`` as a special token, and its id."""
    tok = Tokenizer.from_str(tokenizer.to_str())
    existing = tok.token_to_id(IMAGE_TOKEN)
    if existing is None:
        tok.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
        existing = tok.token_to_id(IMAGE_TOKEN)
    assert existing is not None
    return tok, int(existing)


def build_vlm(
    lm: LlamaForCausalLM, tokenizer: Tokenizer, vision: VisionShape
) -> tuple[LlavaForConditionalGeneration, Tokenizer]:
    """A new VLM around ``lm``'s weights (copied; its embeddings grown for ``<image>`` if needed,
    the new row the mean of the others), a fresh vision tower and projector; and the tokenizer
    with ``<image>``."""
    tok, image_id = with_image_token(tokenizer)
    text_config = LlamaConfig.from_dict(lm.config.to_dict())
    vocab = max(tok.get_vocab_size(), text_config.vocab_size)
    text_config.vocab_size = vocab
    text_config.architectures = ["LlamaForCausalLM"]  # what vLLM builds the language model as
    config = LlavaConfig(
        vision_config=vision.config(),
        text_config=text_config,
        image_token_index=image_id,
        image_seq_length=vision.image_seq_length,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )
    model = LlavaForConditionalGeneration(config)
    init_vision_positions(model)
    state = {k: v.clone() for k, v in lm.state_dict().items()}
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        old = state[key]
        if old.size(0) < vocab:
            grown = old.mean(0, keepdim=True).expand(vocab - old.size(0), -1)
            state[key] = torch.cat([old, grown], 0)
    body = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    model.model.language_model.load_state_dict(body)
    model.lm_head.load_state_dict({"weight": state["lm_head.weight"]})
    model.train()
    return model, tok


def text_config(model: LlavaForConditionalGeneration) -> LlamaConfig:
    config = model.config.text_config
    if not isinstance(config, LlamaConfig):
        raise ValueError(f"the VLM's language model is {type(config).__name__}, not a Llama")
    return config


def image_spec(model: LlavaForConditionalGeneration) -> ImageSpec:
    vision = model.config.vision_config
    size = vision.image_size if isinstance(vision, CLIPVisionConfig) else None
    if not isinstance(size, int):
        raise ValueError(f"the vision tower's image_size must be one int (square images), got {size!r}")
    return ImageSpec(size)


def export_vlm(model: PreTrainedModel, tokenizer: Tokenizer, spec: ImageSpec, out_dir: Path) -> Path:
    """``save_pretrained`` + the tokenizer (``<image>`` special, :data:`CHAT_TEMPLATE`) +
    ``preprocessor_config.json`` (the ``CLIPImageProcessor`` that does :func:`images.preprocess`)
    + ``processor_config.json`` (a ``LlavaProcessor``: patch size and feature strategy, so it
    expands ``<image>`` to ``image_seq_length`` tokens)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    _stock_vision_names(out_dir)
    hf = hf_tokenizer(tokenizer, CHAT_TEMPLATE)
    hf.save_pretrained(out_dir)
    (out_dir / "preprocessor_config.json").write_text(json.dumps(spec.preprocessor_config(), indent=2) + "\n")
    vision = model.config.vision_config
    processor = {
        "processor_class": "LlavaProcessor",
        "patch_size": int(vision.patch_size),
        "vision_feature_select_strategy": model.config.vision_feature_select_strategy,
        "num_additional_image_tokens": 1,
        "image_token": IMAGE_TOKEN,
    }
    (out_dir / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return out_dir


def _stock_vision_names(out_dir: Path) -> None:
    """Rename ``vision_tower.X`` (what transformers 5 writes) to ``vision_tower.vision_model.X``,
    the names of every published LLaVA-1.5 checkpoint, which vLLM's loader maps; transformers
    reads either."""
    index = out_dir / "model.safetensors.index.json"
    for path in sorted(out_dir.glob("*.safetensors")):
        tensors = load_file(path)
        renamed = {_stock_name(k): v for k, v in tensors.items()}
        if renamed.keys() != tensors.keys():
            save_file(renamed, path, metadata={"format": "pt"})
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {_stock_name(k): v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=2) + "\n")


def _stock_name(key: str) -> str:
    prefix = "vision_tower."
    if key.startswith(prefix) and not key.startswith(prefix + "vision_model."):
        return prefix + "vision_model." + key[len(prefix) :]
    return key


@dataclass
class LoadedVlm:
    model: LlavaForConditionalGeneration
    tokenizer: Tokenizer
    spec: ImageSpec

    @property
    def image_token_id(self) -> int:
        return int(self.model.config.image_token_id)

    @property
    def image_seq_length(self) -> int:
        return int(self.model.config.image_seq_length)


def load_vlm(path: Path) -> LoadedVlm:
    """An exported VLM folder (what :func:`export_vlm` writes), float32, eval mode."""
    config = json.loads((path / "config.json").read_text())
    if "LlavaForConditionalGeneration" not in (config.get("architectures") or []):
        raise ValueError(f"{path} holds {config.get('architectures')}, not a LlavaForConditionalGeneration")
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    model.eval()
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    spec = ImageSpec.from_preprocessor_config(json.loads((path / "preprocessor_config.json").read_text()))
    return LoadedVlm(model, tokenizer, spec)
