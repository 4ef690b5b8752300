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

from forge_trainer_agent.training.data import EOT
from forge_trainer_agent.training.recipes import PairsConfig, pair_files

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ 'User: ' + m['content'] + '\\n' }}"
    "{% else %}{{ 'Assistant: ' + m['content'] + eos_token + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
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


def render(messages: list[Message], add_generation_prompt: bool = False) -> str:
    """:data:`CHAT_TEMPLATE` in Python (the tokenizer's Jinja copy must give the same text)."""
    out = []
    for m in messages:
        if m["role"] == "user":
            out.append(f"User: {m['content']}\n")
        else:
            out.append(f"Assistant: {m['content']}{EOT}\n")
    if add_generation_prompt:
        out.append("Assistant:")
    return "".join(out)


def pairs_hash(config: PairsConfig, seed: int, val_fraction: float) -> str:
    h = hashlib.sha256()
    for path in pair_files(config.path):
        h.update(path.read_bytes())
    h.update(f"{config.max_pairs}/{seed}/{val_fraction}".encode())
    return h.hexdigest()[:16]


def _rows(path: Path) -> list[dict[str, str]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def load_pairs(
    config: PairsConfig, seed: int, val_fraction: float
) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """Usable pairs of every file, shuffled by ``seed``, cut to ``max_pairs``; the last
    ``val_fraction`` of them is held out. Raises ValueError when too few are left."""
    pairs = [p for path in pair_files(config.path) for p in map(to_pair, _rows(path)) if p is not None]
    order = np.random.default_rng([seed, 0x9A1B]).permutation(len(pairs))
    pairs = [pairs[int(i)] for i in order]
    if config.max_pairs:
        pairs = pairs[: config.max_pairs]
    held_out = max(1, int(len(pairs) * val_fraction))
    if len(pairs) - held_out < 1:
        raise ValueError(
            f"pairs.path: {config.path!r} has {len(pairs)} usable pairs, too few to hold out {held_out}"
        )
    return pairs[:-held_out], pairs[-held_out:]


@dataclass(frozen=True)
class Encoded:
    """Token ids of a prompt followed by its response(s); the response starts at ``prompt_len``."""

    ids: tuple[int, ...]
    prompt_len: int


def _fit(prompt: list[int], responses: list[list[int]], max_len: int) -> tuple[list[int], list[list[int]]]:
    """Keep the whole of each response if it fits, else at most half of ``max_len`` of it; cut the
    prompt from the left (the latest turns matter most) to what is left."""
    longest = max(len(r) for r in responses)
    if len(prompt) + longest <= max_len:
        return prompt, responses
    keep = max(max_len // 2, max_len - len(prompt))
    responses = [r[:keep] for r in responses]
    room = max_len - max(len(r) for r in responses)
    return prompt[-room:], responses


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
        prompt, responses = _fit(list(prompts[i].ids), responses, max_len)
        out.append(tuple(Encoded(tuple(prompt + r), len(prompt)) for r in responses))
    return out
