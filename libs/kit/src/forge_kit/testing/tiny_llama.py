"""A random tiny Llama with a byte-level BPE tokenizer, saved as the trainer exports checkpoints.

For tests that need a real model_server to serve something: weights are random (seeded), so the
output is noise, but every code path of loading, tokenizing, batching and streaming is the real
one. torch, tokenizers and transformers are imported on call: the kit itself does not need them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

EOT = "<|endoftext|>"

DEFAULT_CORPUS = (
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 8,
)


def train_bpe(corpus: Iterable[str], vocab_size: int, special_tokens: Sequence[str] = ()) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``vocab_size`` trained on ``corpus``, with
    ``<|endoftext|>`` and ``special_tokens`` (each also registered as an added special token)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT, *special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(list(corpus), trainer)
    if special_tokens:
        bpe.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    return bpe


def llama_config(
    vocab_size: int,
    hidden: int,
    layers: int,
    context: int,
    eos_token_id: int,
    initializer_range: float,
    heads: int = 4,
    kv_heads: int = 2,
) -> Any:
    """The tiny Llama's ``LlamaConfig``: ``heads`` over ``kv_heads`` KV heads, no BOS, untied
    embeddings."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=context,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
        initializer_range=initializer_range,
    )


def save_tiny_llama(
    folder: Path,
    *,
    corpus: Iterable[str] = DEFAULT_CORPUS,
    context: int = 256,
    vocab_size: int = 300,
    hidden: int = 64,
    layers: int = 2,
    seed: int = 0,
    chat_template: str | None = None,
    initializer_range: float = 0.02,
    heads: int = 4,
    kv_heads: int = 2,
) -> Path:
    """Train a BPE tokenizer of ``vocab_size`` on ``corpus``, build a random Llama (``layers`` x
    ``hidden``, ``heads`` over ``kv_heads`` KV heads, ``context`` positions, no BOS token, weights
    drawn with ``initializer_range``) and save both into ``folder``; ``chat_template`` goes into
    the tokenizer config. vLLM's CPU attention serves a head size (``hidden / heads``) of 64, not
    the default's 16."""
    import torch
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = train_bpe(corpus, vocab_size)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOT)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    torch.manual_seed(seed)
    config = llama_config(
        bpe.get_vocab_size(),
        hidden,
        layers,
        context,
        tokenizer.eos_token_id,
        initializer_range,
        heads,
        kv_heads,
    )
    folder.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
