"""Hugging Face export: ``save_pretrained`` (safetensors + ``config.json`` + generation config)
and the tokenizer files, so ``transformers`` and vLLM load the result with no Forge code. A causal
LM loads with ``AutoModelForCausalLM``, a reward model with ``AutoModelForSequenceClassification``.
Every export carries a chat template in its tokenizer: chat-tuned models their own, the others
:data:`PLAIN_CHAT_TEMPLATE` (vLLM refuses a chat request for a tokenizer without one)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from forge_training.data import EOT

#: The chat format of a model not tuned for chat: ``role: content`` lines, then ``assistant:``
#: (text parts joined by newlines) — the format Forge's model server falls back to for a tokenizer
#: without a template, so both engines render the same prompt.
PLAIN_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] + ': ' }}"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] if p['type'] == 'text' %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}{{ p['text'] }}{% endfor %}{% endif %}"
    "{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)


def hf_tokenizer(tokenizer: Path | Tokenizer, chat_template: str | None = None) -> PreTrainedTokenizerFast:
    source = Tokenizer.from_file(str(tokenizer)) if isinstance(tokenizer, Path) else tokenizer
    hf = PreTrainedTokenizerFast(
        tokenizer_object=source, bos_token=EOT, eos_token=EOT, unk_token=EOT, pad_token=EOT
    )
    hf.chat_template = PLAIN_CHAT_TEMPLATE if chat_template is None else chat_template
    return hf


def export_hf(
    model: PreTrainedModel, tokenizer: Path | Tokenizer, out_dir: Path, chat_template: str | None = None
) -> Path:
    """Write ``model`` and its tokenizer to ``out_dir`` in Hugging Face format, with
    ``chat_template`` (default :data:`PLAIN_CHAT_TEMPLATE`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    hf_tokenizer(tokenizer, chat_template).save_pretrained(out_dir)
    return out_dir
