"""Scoring HH-RLHF pairs with a reward-model checkpoint: held-out pairwise accuracy.

The checkpoint is a Hugging Face directory as the trainer's ``reward_hh`` recipe exports it: a
``LlamaForSequenceClassification``-style model with one label (the reward, read at the last
non-padding token) and its tokenizer, whose chat template renders conversations as::

    User: {content}\\n
    Assistant: {content}<eos>\\n

A pair is scored as it was trained: the prompt (every turn before the last Assistant turn)
rendered with the generation prompt ``Assistant:``, followed by ``" " + response`` with no
end-of-text token (it is the padding token, which the head's pooling skips); prompt and response
are tokenized separately and concatenated, and when a pair is longer than ``max_length`` each
response keeps at most half of it and the prompt is cut from the left. Pairs the trainer would
drop (no final Assistant turn, prompts that differ, empty or identical responses) are counted
as skipped, not scored.

An encoder checkpoint, one whose tokenizer wraps a sequence in ``[CLS] … [SEP]`` (BERT; the
trainer's ``reward_hh_minilm`` recipe exports ``BertForSequenceClassification``, which reads the
reward at ``[CLS]``), is scored as that recipe trains it: ``[CLS] prompt + " " + response [SEP]``
with the tokens cut from the *left* when too long (:func:`forge_training.pairs.keep_end`), so the final response
survives and the oldest turns go first, and ``max_length`` defaults to the tokenizer's
``model_max_length`` (the length it was trained at) when that is set. Its chat template (or, if
it has none, the same template with no end-of-sequence token) renders the prompt.

Accuracy is the share of pairs whose chosen response scores above the rejected one, a tie
counting one half (as the trainer's validation does); the 95 % interval is the Wilson score
interval, which stays inside [0, 1] and is sensible for small n. The same accuracy is also
given by which reply is longer (``by_length``: preferred-longer, preferred-shorter and tied pairs,
lengths in words; see :mod:`forge_experiments.rmlength`), so a reward model that only learned "longer is
better" shows as one.

A checkpoint folder may hold ``length_adjust.json`` (:class:`LengthAdjust`, written by
:mod:`forge_training.rm.residual`): the reward is then the model's score less ``slope x log(1 +
words in the response)``, a length term fitted on the model's training pairs only; every score
this module gives (pairs, :meth:`RewardModel.reward`) is the adjusted one.

``torch`` and ``transformers`` are imported only when a checkpoint is loaded: reading pairs needs
neither (the feedback service's ``forge rm`` commands import this module).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forge_experiments import rmlength
from forge_kit.stats import wilson_interval
from forge_training.pairs import fit, keep_end

_TURN = re.compile(r"\n\n(Human|Assistant):")
_ROLES = {"Human": "user", "Assistant": "assistant"}
INTERVAL = "wilson"


class PairsError(ValueError):
    """A pairs file that cannot be read; the message names the line and the field."""


LENGTH_ADJUST_FILE = "length_adjust.json"
_ADJUST_MAX_BYTES = 64 << 10


def length_feature(response: str) -> float:
    """The length term's variable: ``log(1 + words)`` of a response (:func:`forge_experiments.rmlength.words`)."""
    return math.log1p(rmlength.words(response))


@dataclass(frozen=True)
class LengthAdjust:
    """A post-hoc length correction of a reward model: ``reward - slope x`` :func:`length_feature`
    (``slope`` fitted by least squares of the raw reward on the feature over the training pairs'
    replies, so the corrected reward is uncorrelated with it there). ``fitted_on`` names the pairs
    (sha256 of their file) and ``n`` counts the replies."""

    slope: float
    intercept: float
    n: int
    fitted_on: str
    feature: str = "log1p_words"

    def apply(self, reward: float, response: str) -> float:
        return reward - self.slope * length_feature(response)

    @classmethod
    def read(cls, folder: Path) -> LengthAdjust | None:
        """The folder's ``length_adjust.json``, None when it has none; PairsError when unusable."""
        path = folder / LENGTH_ADJUST_FILE
        if not path.is_file():
            return None
        if path.stat().st_size > _ADJUST_MAX_BYTES:
            raise PairsError(f"--checkpoint: {path} is over {_ADJUST_MAX_BYTES} bytes")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            made = cls(float(raw["slope"]), float(raw["intercept"]), int(raw["n"]), str(raw["fitted_on"]),
                       str(raw["feature"]))  # fmt: skip
        except (ValueError, KeyError, TypeError) as exc:
            raise PairsError(f"--checkpoint: {path} is not a length adjustment ({exc})") from None
        if (
            made.feature != "log1p_words"
            or not math.isfinite(made.slope)
            or not math.isfinite(made.intercept)
        ):
            raise PairsError(f"--checkpoint: {path}: feature must be log1p_words and slope finite")
        return made

    def write(self, folder: Path) -> Path:
        path = folder / LENGTH_ADJUST_FILE
        partial = folder / f".{LENGTH_ADJUST_FILE}.partial"
        partial.write_text(json.dumps(self.__dict__, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        partial.replace(path)
        return path


@dataclass(frozen=True)
class Pair:
    """One scorable pair: the conversation before the last Assistant turn and the two answers."""

    line: int
    messages: tuple[tuple[str, str], ...]
    chosen: str
    rejected: str


def parse_transcript(text: str) -> list[tuple[str, str]]:
    """``[(role, content), ...]`` of an HH-RLHF transcript (roles ``user`` / ``assistant``)."""
    pieces = _TURN.split(text)
    return [(_ROLES[pieces[i]], pieces[i + 1].strip()) for i in range(1, len(pieces) - 1, 2)]


def to_pair(line: int, row: dict[str, Any]) -> Pair | str:
    """The pair of one row, or why it is skipped."""
    chosen, rejected = parse_transcript(row["chosen"]), parse_transcript(row["rejected"])
    if not chosen or not rejected or chosen[-1][0] != "assistant" or rejected[-1][0] != "assistant":
        return "no final Assistant turn"
    if chosen[:-1] != rejected[:-1] or not chosen[:-1]:
        return "prompts differ"
    good, bad = chosen[-1][1], rejected[-1][1]
    if not good or not bad:
        return "empty response"
    if good == bad:
        return "identical responses"
    return Pair(line, tuple(chosen[:-1]), good, bad)


def read_pairs(path: Path, skipped: Counter[str]) -> Iterator[Pair]:
    """Scorable pairs of a ``.jsonl`` or ``.jsonl.gz`` file of HH-RLHF rows (``chosen``,
    ``rejected`` full transcripts); the others are counted in ``skipped`` by reason."""
    if not path.is_file():
        raise PairsError(f"--pairs: {path} is not a file")
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for number, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                raise PairsError(f"--pairs: line {number} is not JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise PairsError(f"--pairs: line {number} is not a JSON object")
            for name in ("chosen", "rejected"):
                if not isinstance(row.get(name), str):
                    raise PairsError(f"--pairs: line {number}: {name!r} must be a string (a full transcript)")
            pair = to_pair(number, row)
            if isinstance(pair, str):
                skipped[pair] += 1
            else:
                yield pair


@dataclass
class Scores:
    """Per-pair rewards and the accuracy they give."""

    chosen: list[float] = field(default_factory=list)
    rejected: list[float] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    strata: list[str] = field(default_factory=list)
    """Per pair, which reply is longer (one of :data:`forge_experiments.rmlength.STRATA`)."""

    @property
    def n(self) -> int:
        return len(self.chosen)

    def wins(self) -> float:
        """Pairs ranked right, a tie counting one half."""
        return sum(
            1.0 if c > r else 0.5 if c == r else 0.0 for c, r in zip(self.chosen, self.rejected, strict=True)
        )

    def summary(self) -> dict[str, Any]:
        """``{"accuracy", "ci95_low", "ci95_high", "n", "by_length"}`` (Wilson intervals;
        ``by_length`` as :func:`forge_experiments.rmlength.as_summary` writes it)."""
        if not self.n:
            raise PairsError("--pairs: no scorable pair in the file")
        wins = self.wins()
        low, high = wilson_interval(wins, self.n)
        by_length = rmlength.stratified_accuracy(self.strata, self.chosen, self.rejected)
        return {
            "accuracy": wins / self.n,
            "ci95_low": low,
            "ci95_high": high,
            "n": self.n,
            "by_length": rmlength.as_summary(by_length),
        }


class RewardModel:
    """A Hugging Face reward-model checkpoint on CPU (or ``device``), ready to score pairs."""

    def __init__(
        self, checkpoint: Path, *, device: str = "cpu", max_length: int = 0, raw: bool = False
    ) -> None:
        """``raw``: ignore the checkpoint's ``length_adjust.json`` (to fit one)."""
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if not (checkpoint / "config.json").is_file():
            raise PairsError(
                f"--checkpoint: {checkpoint} has no config.json (not a Hugging Face model folder)"
            )
        self._torch = torch
        self.length_adjust = None if raw else LengthAdjust.read(checkpoint)
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        self.model = AutoModelForSequenceClassification.from_pretrained(checkpoint).to(device).eval()
        self.device = device
        if self.model.config.num_labels != 1:
            raise PairsError(
                f"--checkpoint: the model has {self.model.config.num_labels} labels; a reward model has 1"
            )
        pad = self.model.config.pad_token_id
        if pad is None:
            pad = (
                self.tokenizer.pad_token_id
                if self.tokenizer.pad_token_id is not None
                else self.tokenizer.eos_token_id
            )
            self.model.config.pad_token_id = pad
        if pad is None:
            raise PairsError("--checkpoint: neither the model nor the tokenizer names a padding token")
        self.pad_id = int(pad)
        cls_id, sep_id = self.tokenizer.cls_token_id, self.tokenizer.sep_token_id
        self.wrap: tuple[int, int] | None = None
        """``([CLS], [SEP])`` ids for an encoder checkpoint (see the module docstring)."""
        if cls_id is not None and sep_id is not None and self.tokenizer.num_special_tokens_to_add() > 0:
            self.wrap = (int(cls_id), int(sep_id))
        limit = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)
        trained = int(getattr(self.tokenizer, "model_max_length", 0) or 0)
        default = trained if self.wrap is not None and 0 < trained < 1_000_000 else limit
        wanted = max_length or default or 512
        self.max_length = min(wanted, limit) if limit else wanted

    def render_prompt(self, messages: tuple[tuple[str, str], ...]) -> str:
        """The conversation with the generation prompt, by the tokenizer's chat template when it
        has one, else by the same template written out."""
        turns = [{"role": role, "content": content} for role, content in messages]
        if getattr(self.tokenizer, "chat_template", None):
            return str(self.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False))
        eos = (self.tokenizer.eos_token or "") if self.wrap is None else ""
        parts = [
            f"User: {t['content']}\n" if t["role"] == "user" else f"Assistant: {t['content']}{eos}\n"
            for t in turns
        ]
        return "".join(parts) + "Assistant:"

    def encode(self, pair: Pair) -> tuple[list[int], list[int]]:
        """Token ids of prompt + chosen and prompt + rejected, cut to ``max_length``: by
        :func:`fit` for a decoder, from the left inside ``[CLS] … [SEP]`` for an encoder."""
        encode = self.tokenizer

        def ids(text: str) -> list[int]:
            return list(encode(text, add_special_tokens=False)["input_ids"])

        if self.wrap is not None:
            prompt_ids = ids(self.render_prompt(pair.messages))
            return (
                keep_end(prompt_ids + ids(" " + pair.chosen), self.max_length, *self.wrap),
                keep_end(prompt_ids + ids(" " + pair.rejected), self.max_length, *self.wrap),
            )
        prompt, (good, bad) = fit(
            ids(self.render_prompt(pair.messages)),
            [ids(" " + pair.chosen), ids(" " + pair.rejected)],
            self.max_length,
        )
        return prompt + good, prompt + bad

    def reward(self, messages: tuple[tuple[str, str], ...], response: str) -> float:
        """The reward of one ``response`` to the conversation ``messages``, encoded as a pair's
        reply is (:meth:`encode`) and adjusted (:meth:`adjusted`)."""
        (ids, _) = self.encode(Pair(0, messages, response, response))
        return self.adjusted(self.score([ids])[0], response)

    def adjusted(self, score: float, response: str) -> float:
        """The reward of ``response`` from the model's raw ``score`` of it (see :class:`LengthAdjust`)."""
        return score if self.length_adjust is None else self.length_adjust.apply(score, response)

    def score(self, sequences: list[list[int]]) -> list[float]:
        """The raw score of each token sequence (right-padded into one batch): the reward before
        :meth:`adjusted`."""
        torch = self._torch
        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, seq in enumerate(sequences):
            ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, : len(seq)] = 1
        with torch.inference_mode():
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
        return [float(v) for v in logits[:, 0].float().cpu()]


def evaluate(
    model: RewardModel,
    pairs: Iterator[Pair],
    *,
    batch_size: int = 16,
    on_scored: Callable[[int], None] = lambda count: None,
) -> Scores:
    """Score every pair: chosen and rejected of ``batch_size`` pairs go in one forward pass;
    ``on_scored`` gets the number of pairs of each batch scored (for a progress bar)."""
    scores = Scores()
    batch: list[Pair] = []

    def flush() -> None:
        encoded = [model.encode(p) for p in batch]
        rewards = model.score([e[0] for e in encoded] + [e[1] for e in encoded])
        scores.chosen.extend(
            model.adjusted(r, p.chosen) for r, p in zip(rewards[: len(batch)], batch, strict=True)
        )
        scores.rejected.extend(
            model.adjusted(r, p.rejected) for r, p in zip(rewards[len(batch) :], batch, strict=True)
        )
        scores.lines.extend(p.line for p in batch)
        scores.strata.extend(rmlength.stratum(p.chosen, p.rejected) for p in batch)
        on_scored(len(batch))
        batch.clear()

    for pair in pairs:
        batch.append(pair)
        if len(batch) == batch_size:
            flush()
    if batch:
        flush()
    return scores


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_results(out: Path, scores: Scores, details: dict[str, Any]) -> dict[str, Any]:
    """``summary.json`` (the benchmark contract), ``details.json`` (how it was computed) and
    ``scores.jsonl.gz`` (every pair's two rewards), each written to a temporary name first."""
    summary = scores.summary()
    out.mkdir(parents=True, exist_ok=True)
    margins = [c - r for c, r in zip(scores.chosen, scores.rejected, strict=True)]
    details = {
        **details,
        "interval": INTERVAL,
        "ties": sum(1 for m in margins if m == 0),
        "mean_margin": sum(margins) / len(margins),
    }
    rows = "".join(
        json.dumps({"line": line, "reward_chosen": c, "reward_rejected": r, "length": s}) + "\n"
        for line, c, r, s in zip(scores.lines, scores.chosen, scores.rejected, scores.strata, strict=True)
    )
    for name, data in (
        ("scores.jsonl.gz", gzip.compress(rows.encode(), mtime=0)),
        ("details.json", (json.dumps(details, indent=2, sort_keys=True) + "\n").encode()),
        ("summary.json", (json.dumps(summary, indent=2, sort_keys=True) + "\n").encode()),
    ):
        partial = out / f".{name}.partial"
        partial.write_bytes(data)
        partial.replace(out / name)
    return summary
