"""A tiny Hugging Face Llama checkpoint made in the test: random weights (seeded), a byte-level BPE
tokenizer trained on a slice of tinyshakespeare, saved with ``save_pretrained`` — the same files a
training run exports (safetensors, config.json, tokenizer files), small enough to load in a second."""

from __future__ import annotations

from pathlib import Path

from forge_eval.spec import resolve_data_path

CORPUS = resolve_data_path("../shared/data/corpora") / "tinyshakespeare" / "input.txt"


def make_tiny_checkpoint(folder: Path, *, seed: int = 0, context: int = 32, vocab: int = 300) -> Path:
    """Write a 2-layer, 32-wide Llama with a ``context``-token window to ``folder``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([CORPUS.read_text()[:20_000]], trainer=trainer)
    eot = "<|endoftext|>"
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=eot, eos_token=eot, unk_token=eot, pad_token=eot
    )
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=bpe.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=context,
        bos_token_id=0,
        eos_token_id=0,
    )
    folder.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder
