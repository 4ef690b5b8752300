"""Hugging Face export: ``save_pretrained`` (safetensors + ``config.json``) and the tokenizer
files, so ``transformers`` (and vLLM on a GPU) load the result with no Forge code."""

from __future__ import annotations

from pathlib import Path

from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from forge_trainer_agent.training.data import EOT


def hf_tokenizer(tokenizer_file: Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_file), bos_token=EOT, eos_token=EOT, unk_token=EOT, pad_token=EOT
    )


def export_hf(model: LlamaForCausalLM, tokenizer_file: Path, out_dir: Path) -> Path:
    """Write ``model`` and its tokenizer to ``out_dir`` in Hugging Face format."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    hf_tokenizer(tokenizer_file).save_pretrained(out_dir)
    return out_dir
