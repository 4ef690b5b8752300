"""Prompt/response data for ``sft``, ``reward`` and ``dpo``: HH-RLHF pairs in a chat template.

An HH-RLHF row is ``{"chosen": transcript, "rejected": transcript}``, a transcript being
``"\\n\\nHuman: ...\\n\\nAssistant: ..."`` turns. The prompt is the conversation up to the last
Assistant turn, which is the response. Pairs whose two prompts differ, whose responses are equal
or empty are dropped (the data's README warns of a few).

Conversations are rendered with :data:`CHAT_TEMPLATE`, which the export also stores in the
tokenizer, so ``tokenizer.apply_chat_template`` gives the same text::

    User: {content}\\n
    Assistant: {content}<|endoftext|>\\n

A prompt ends with the generation prompt ``Assistant:``; the response is ``" {content}"`` and,
for language-model tasks, the end-of-text token. Prompt and response are encoded separately and
concatenated, so the loss mask falls exactly on the response tokens.

An encoder reward model (``init.backbone=minilm``) reads :data:`ENCODER_CHAT_TEMPLATE`, the same
text without end-of-text markers (its WordPiece vocabulary has none), as ``[CLS] prompt + " " +
response [SEP]`` cut from the left (:func:`encode_pairs_for_encoder`): the end of the
conversation, i.e. the final response, is what survives a long transcript.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from forge_training.data import EOT
from forge_training.datafiles import pair_files
from forge_training.schema import PairsConfig

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ 'User: ' + m['content'] + '\\n' }}"
    "{% else %}{{ 'Assistant: ' + m['content'] + eos_token + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
#: :data:`CHAT_TEMPLATE` without the end-of-text token, for tokenizers that have none (WordPiece).
ENCODER_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(" + eos_token", "")
_TURN = re.compile(r"\n\n(Human|Assistant):")
_ROLES = {"Human": "user", "Assistant": "assistant"}

Message = dict[str, str]


@dataclass(frozen=True)
class PreferencePair:
    """A prompt (all turns before the final Assistant turn) and two candidate responses."""

    prompt: tuple[tuple[str, str], ...]
    chosen: str
    rejected: str

    def messages(self) -> list[Message]:
        return [{"role": role, "content": content} for role, content in self.prompt]


def parse_transcript(text: str) -> list[tuple[str, str]]:
    """``[(role, content), ...]`` of an HH-RLHF transcript (roles ``user``/``assistant``)."""
    pieces = _TURN.split(text)
    turns = []
    for i in range(1, len(pieces) - 1, 2):
        turns.append((_ROLES[pieces[i]], pieces[i + 1].strip()))
    return turns


def to_pair(row: dict[str, str]) -> PreferencePair | None:
    """The pair of one row, or None when it is unusable (see the module docstring)."""
    chosen, rejected = parse_transcript(row.get("chosen", "")), parse_transcript(row.get("rejected", ""))
    if not chosen or not rejected or chosen[-1][0] != "assistant" or rejected[-1][0] != "assistant":
        return None
    if chosen[:-1] != rejected[:-1] or not chosen[:-1]:
        return None
    good, bad = chosen[-1][1], rejected[-1][1]
    if not good or not bad or good == bad:
        return None
    return PreferencePair(tuple(chosen[:-1]), good, bad)


def render(messages: list[Message], add_generation_prompt: bool = False, eos: str = EOT) -> str:
    """:data:`CHAT_TEMPLATE` in Python (the tokenizer's Jinja copy must give the same text); with
    ``eos=""`` :data:`ENCODER_CHAT_TEMPLATE`."""
    out = []
    for m in messages:
        if m["role"] == "user":
            out.append(f"User: {m['content']}\n")
        else:
            out.append(f"Assistant: {m['content']}{eos}\n")
    if add_generation_prompt:
        out.append("Assistant:")
    return "".join(out)


def pairs_hash(config: PairsConfig, seed: int, val_fraction: float) -> str:
    h = hashlib.sha256()
    for path in pair_files(config.path):
        h.update(path.read_bytes())
    h.update(f"{config.max_pairs}/{seed}/{val_fraction}".encode())
    if config.extra_train or config.exclude_shared_openings:  # older runs keep their hash
        for path in pair_files(config.extra_train, "pairs.extra_train") if config.extra_train else []:
            h.update(path.read_bytes())
        h.update(f"/extra:{bool(config.extra_train)}/exclude:{config.exclude_shared_openings}".encode())
    if config.length_balance != "none":
        h.update(f"/length_balance:{config.length_balance}".encode())
    if config.extra_val_fraction:
        h.update(f"/extra_val:{config.extra_val_fraction}".encode())
    return h.hexdigest()[:16]


def _rows(path: Path) -> list[dict[str, str]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _usable(files: list[Path]) -> list[PreferencePair]:
    return [p for path in files for p in map(to_pair, _rows(path)) if p is not None]


def opening(pair: PreferencePair) -> str:
    """The conversation's first user turn (HH-RLHF prompts start with one)."""
    return pair.prompt[0][1]


def split_extra(config: PairsConfig, seed: int) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """The ``extra_train`` pairs as (trainable, held out): all of them trainable when
    ``extra_val_fraction`` is 0, else shuffled by ``seed`` and the last ``extra_val_fraction`` of
    them (at least one) held out. Neither list is filtered against the main held-out set here."""
    if not config.extra_train:
        return [], []
    extra = _usable(pair_files(config.extra_train, "pairs.extra_train"))
    if not config.extra_val_fraction:
        return extra, []
    order = np.random.default_rng([seed, 0xE7A5]).permutation(len(extra))
    extra = [extra[int(i)] for i in order]
    held_out = max(1, int(len(extra) * config.extra_val_fraction))
    if len(extra) - held_out < 1:
        raise ValueError(f"pairs.extra_train: {len(extra)} usable pairs, too few to hold out {held_out}")
    return extra[:-held_out], extra[-held_out:]


def load_pairs(
    config: PairsConfig, seed: int, val_fraction: float
) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """Usable pairs of every file of ``path``, shuffled by ``seed``, cut to ``max_pairs``; the last
    ``val_fraction`` of them is held out, the rest trained on. With ``exclude_shared_openings``
    training pairs that open like a held-out pair (of ``path``, or of ``extra_train``'s held-out
    share, :func:`split_extra`) are dropped; ``extra_train`` pairs (never held out, never opening
    like a held-out pair) are appended to training. Raises ValueError when too few are left."""
    pairs = _usable(pair_files(config.path))
    order = np.random.default_rng([seed, 0x9A1B]).permutation(len(pairs))
    pairs = [pairs[int(i)] for i in order]
    if config.max_pairs:
        pairs = pairs[: config.max_pairs]
    held_out = max(1, int(len(pairs) * val_fraction))
    if len(pairs) - held_out < 1:
        raise ValueError(
            f"pairs.path: {config.path!r} has {len(pairs)} usable pairs, too few to hold out {held_out}"
        )
    train, val = pairs[:-held_out], pairs[-held_out:]
    if config.exclude_shared_openings or config.extra_train:
        extra, extra_held = split_extra(config, seed)
        held = set(val) | set(extra_held)
        seen = {opening(p) for p in val}
        if config.exclude_shared_openings:
            seen |= {opening(p) for p in extra_held}
            train = [p for p in train if opening(p) not in seen and p not in held]
        train += [p for p in extra if p not in held and opening(p) not in seen]
        if not train:
            raise ValueError(f"pairs.path: no training pair is left beside the {len(val)} held out")
    return train, val


def transcript(pair: PreferencePair, response: str) -> str:
    """The HH-RLHF transcript of the pair's prompt followed by ``response`` (what :func:`to_pair`
    parses back into the same pair)."""
    names = {"user": "Human", "assistant": "Assistant"}
    turns = [*pair.prompt, ("assistant", response)]
    return "".join(f"\n\n{names[role]}: {content}" for role, content in turns)


def write_pairs(path: Path, pairs: list[PreferencePair]) -> Path:
    """``pairs`` as an HH-RLHF ``.jsonl`` file (``{"chosen", "rejected"}`` transcripts), as
    ``forge rm eval --pairs`` reads them; written to a temporary name first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = "".join(
        json.dumps({"chosen": transcript(p, p.chosen), "rejected": transcript(p, p.rejected)}) + "\n"
        for p in pairs
    )
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(rows, encoding="utf-8")
    partial.replace(path)
    return path


@dataclass(frozen=True)
class Encoded:
    """Token ids of a prompt followed by its response(s); the response starts at ``prompt_len``."""

    ids: tuple[int, ...]
    prompt_len: int


def fit(prompt: list[int], responses: list[list[int]], max_len: int) -> tuple[list[int], list[list[int]]]:
    """The pairwise truncation rule, the one training (:func:`encode_pairs`) and scoring
    (:mod:`forge_training.rm.eval`) share: keep the whole of each response if it fits, else at
    most half of ``max_len`` of it; cut the prompt from the left (the latest turns matter most) to
    what is left, which may be nothing (``prompt[-0:]`` would be the whole prompt)."""
    longest = max(len(r) for r in responses)
    if len(prompt) + longest <= max_len:
        return prompt, responses
    keep = max(max_len // 2, max_len - len(prompt))
    responses = [r[:keep] for r in responses]
    room = max_len - max(len(r) for r in responses)
    return (prompt[-room:] if room > 0 else []), responses


def encode_pairs(
    tok: Tokenizer, pairs: list[PreferencePair], max_len: int, *, end_of_text: bool, chosen_only: bool = False
) -> list[tuple[Encoded, ...]]:
    """Each pair as (chosen,) or (chosen, rejected) prompt+response ids of at most ``max_len``
    tokens, sharing one prompt cut."""
    eot = tok.token_to_id(EOT)
    if eot is None:
        raise ValueError(f"the tokenizer has no {EOT} token")
    prompts = tok.encode_batch([render(p.messages(), add_generation_prompt=True) for p in pairs])
    goods = tok.encode_batch([" " + p.chosen for p in pairs])
    bads = [] if chosen_only else tok.encode_batch([" " + p.rejected for p in pairs])
    tail = [eot] if end_of_text else []
    out = []
    for i in range(len(pairs)):
        responses = [goods[i].ids + tail] + ([] if chosen_only else [bads[i].ids + tail])
        prompt, responses = fit(list(prompts[i].ids), responses, max_len)
        out.append(tuple(Encoded(tuple(prompt + r), len(prompt)) for r in responses))
    return out


def keep_end(ids: list[int], max_len: int, cls_id: int, sep_id: int) -> list[int]:
    """``[CLS] ids [SEP]`` in at most ``max_len`` tokens (at least one of ``ids``), ``ids`` cut from
    the left: an encoder reward model sees the end of the conversation, the final response,
    whatever its length. The rule training (:func:`encode_pairs_for_encoder`) and scoring
    (:mod:`forge_training.rm.eval`) share."""
    room = max(max_len - 2, 1)
    return [cls_id, *ids[-room:], sep_id]


def encode_pairs_for_encoder(
    tok: Tokenizer, pairs: list[PreferencePair], max_len: int, cls_id: int, sep_id: int
) -> list[tuple[Encoded, Encoded]]:
    """Each pair as (chosen, rejected) ``[CLS] prompt + " " + response [SEP]`` ids of at most
    ``max_len`` tokens, the prompt rendered by :data:`ENCODER_CHAT_TEMPLATE`. A longer sequence
    loses tokens from the left (the oldest turns first; the start of the response only when the
    response alone is longer than ``max_len - 2``), so the end of the conversation survives.
    ``prompt_len`` is where the response starts (1 when none of the prompt is left)."""
    if max_len < 3:
        raise ValueError(f"data.seq_len: [CLS] and [SEP] need room for text, got {max_len}")
    tok.no_truncation()  # sentence-transformers' tokenizer.json truncates and pads to 128 itself
    tok.no_padding()
    prompts = tok.encode_batch(
        [render(p.messages(), add_generation_prompt=True, eos="") for p in pairs], add_special_tokens=False
    )
    goods = tok.encode_batch([" " + p.chosen for p in pairs], add_special_tokens=False)
    bads = tok.encode_batch([" " + p.rejected for p in pairs], add_special_tokens=False)
    out = []
    for prompt, good, bad in zip(prompts, goods, bads, strict=True):
        rows = []
        for response in (good.ids, bad.ids):
            text = list(prompt.ids) + list(response)
            wrapped = keep_end(text, max_len, cls_id, sep_id)
            dropped = len(text) - (len(wrapped) - 2)
            rows.append(Encoded(tuple(wrapped), 1 + max(0, len(prompt.ids) - dropped)))
        out.append((rows[0], rows[1]))
    return out
