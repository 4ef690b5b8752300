"""A random tiny LLaVA (CLIP vision tower + MLP projector + Llama) saved as a vision-language export.

For tests that need a real model_server to serve images: ``LlavaForConditionalGeneration`` with
random (seeded) weights, a byte-level BPE tokenizer with the ``<image>`` special token
(``config.image_token_id``), a chat template in which an image part renders as ``<image>``, and a
``preprocessor_config.json`` (a CLIP image processor) and ``processor_config.json`` (a
``LlavaProcessor``'s patch size and feature strategy, as Forge's export writes). Every image is ``image_seq_length`` =
(image_size / patch_size)^2 placeholders. torch, tokenizers and transformers are imported on call.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from forge_kit.testing.tiny_llama import DEFAULT_CORPUS, EOT, llama_config, train_bpe

IMAGE_TOKEN = "<image>"
#: Each message: ``<role>: `` then its parts (an image part is ``<image>``, a text part its text), a
#: newline; the prompt ends with ``assistant:``.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def save_tiny_llava(
    folder: Path,
    *,
    corpus: Iterable[str] = DEFAULT_CORPUS,
    context: int = 256,
    vocab_size: int = 300,
    hidden: int = 64,
    seed: int = 0,
    image_size: int = 32,
    patch_size: int = 8,
    initializer_range: float = 0.2,
) -> Path:
    """Train the tokenizer on ``corpus``, build a random LLaVA (2-layer Llama of ``hidden`` with 4
    heads over 2 KV heads; 2-layer CLIP tower of width 32 on ``image_size`` pixels in
    ``patch_size`` patches) and save model, tokenizer and image processor into ``folder``."""
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        PreTrainedTokenizerFast,
    )

    bpe = train_bpe(corpus, vocab_size, [IMAGE_TOKEN])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOT)
    tokenizer.chat_template = CHAT_TEMPLATE
    image_token_id = bpe.token_to_id(IMAGE_TOKEN)
    assert image_token_id is not None
    torch.manual_seed(seed)
    text = llama_config(bpe.get_vocab_size(), hidden, 2, context, tokenizer.eos_token_id, initializer_range)
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch_size,
        initializer_range=initializer_range,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_id,
        image_seq_length=(image_size // patch_size) ** 2,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    folder.mkdir(parents=True, exist_ok=True)
    model = LlavaForConditionalGeneration(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    ).save_pretrained(folder)
    # A LlavaProcessor's settings, as Forge's VLM export writes them: vLLM expands ``<image>`` with it.
    processor = {
        "processor_class": "LlavaProcessor",
        "patch_size": patch_size,
        "vision_feature_select_strategy": "default",
        "num_additional_image_tokens": 1,
        "image_token": IMAGE_TOKEN,
    }
    (folder / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    return folder
