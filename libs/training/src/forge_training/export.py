"""Hugging Face export: ``save_pretrained`` (safetensors + ``config.json``) and the tokenizer
files, so ``transformers`` (and vLLM on a GPU) load the result with no Forge code. A causal LM
loads with ``AutoModelForCausalLM``, a reward model with ``AutoModelForSequenceClassification``;
chat-tuned models carry their chat template in the tokenizer."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from forge_training.data import EOT


def hf_tokenizer(tokenizer: Path | Tokenizer, chat_template: str | None = None) -> PreTrainedTokenizerFast:
    source = Tokenizer.from_file(str(tokenizer)) if isinstance(tokenizer, Path) else tokenizer
    hf = PreTrainedTokenizerFast(
        tokenizer_object=source, bos_token=EOT, eos_token=EOT, unk_token=EOT, pad_token=EOT
    )
    if chat_template is not None:
        hf.chat_template = chat_template
    return hf


def export_hf(
    model: PreTrainedModel, tokenizer: Path | Tokenizer, out_dir: Path, chat_template: str | None = None
) -> Path:
    """Write ``model`` and its tokenizer to ``out_dir`` in Hugging Face format."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    hf_tokenizer(tokenizer, chat_template).save_pretrained(out_dir)
    return out_dir
