"""A tiny Hugging Face Llama checkpoint made in the test: random weights (seeded), a byte-level BPE
tokenizer trained on a slice of tinyshakespeare, saved with ``save_pretrained`` — the same files a
training run exports (safetensors, config.json, tokenizer files), small enough to load in a second."""

from __future__ import annotations

from pathlib import Path

from forge_kit.paths import resolve_data_path

CORPUS = resolve_data_path("corpora") / "tinyshakespeare" / "input.txt"


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


def train_tiny_checkpoint(folder: Path, *, steps: int = 60, seed: int = 0) -> Path:
    """Train the checkpoint in ``folder`` in place for ``steps`` AdamW steps on the corpus's head
    (the first 90%, outside the held-out tail the perplexity task reads): enough to score clearly
    fewer bits per byte than the random model it started from."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = LlamaForCausalLM.from_pretrained(folder)
    context = int(model.config.max_position_embeddings)
    text = CORPUS.read_text()
    ids = torch.tensor(tokenizer(text[: int(len(text) * 0.9)][:200_000])["input_ids"])
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - context, (16,), generator=generator)
        batch = torch.stack([ids[s : s + context] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    return folder
