"""Training snapshots: accepted preference pairs in HH-RLHF format, for reward-model training.

A snapshot is the answer to "which human pairs was this reward model trained and tested on":
``train.jsonl.gz`` and ``test.jsonl.gz`` (each line ``{"chosen", "rejected", ...}`` with full
transcripts, the format ``forge rm eval`` and the trainer read) and ``manifest.json`` with the
snapshot id (a digest of both files), the high-water mark (time of the last preference included) and every
exclusion with its reason. Which split a comparison lands in is a hash of its id, so the
held-out set stays held out as the data grows. The folder is written under a temporary name and
renamed, so a reader never sees half a snapshot.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from forge_preference_feedback.seeds import ASSISTANT

SNAPSHOT_FORMAT = "forge.preference_snapshot.v1"


@dataclass(frozen=True)
class RatedPair:
    """One recorded A/B preference with what is needed to export it."""

    preference_id: str
    comparison_id: str
    rater_id: str
    prompt: str
    chosen: str
    rejected: str
    recorded_at: str
    """ISO time of recording; the snapshot's high-water mark is the latest exported."""


@dataclass
class SnapshotManifest:
    """What a snapshot holds and what it left out, and why."""

    snapshot_id: str
    format: str
    train_pairs: int
    test_pairs: int
    heldout_fraction: float
    last_recorded_at: str
    excluded_raters: dict[str, list[str]] = field(default_factory=dict)
    excluded: dict[str, int] = field(default_factory=dict)


def heldout(comparison_id: str, fraction: float) -> bool:
    """Whether a comparison belongs to the held-out split (stable: a hash of its id)."""
    bucket = int(hashlib.sha256(comparison_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return bucket < fraction


def transcript(prompt: str, response: str) -> str:
    """The HH-RLHF full transcript of a response to a prompt. Every turn, the first one too,
    starts with a blank line as in HH-RLHF (stored prompts are stripped): readers split turns on
    ``"\n\nHuman:"``, and without it a one-turn prompt would read as no prompt at all."""
    return f"\n\n{prompt.lstrip()}{ASSISTANT} {response}"


def write_snapshot(
    pairs: Iterable[RatedPair],
    out: Path,
    *,
    heldout_fraction: float,
    excluded_raters: dict[str, list[str]],
    excluded: Counter[str],
    weights: dict[str, float],
) -> SnapshotManifest:
    """Write the snapshot folder ``out`` atomically; ``out`` must not exist yet.

    1. Split each pair by its comparison id; drop pairs of excluded raters (counted).
    2. Write both splits and hash them; the snapshot id is the digest of the two files.
    3. Write the manifest, then rename the temporary folder to ``out``.
    """
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError("heldout_fraction must be in [0, 1)")
    if out.exists():
        raise FileExistsError(f"{out} already exists; snapshots are immutable")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    counts = {"train": 0, "test": 0}
    digest = hashlib.sha256()
    last = ""
    try:
        # 1-2. Split, filter and write; gzip with mtime 0 so equal data gives equal bytes.
        with (
            gzip.GzipFile(tmp / "train.jsonl.gz", "wb", mtime=0) as train,
            gzip.GzipFile(tmp / "test.jsonl.gz", "wb", mtime=0) as test,
        ):
            for pair in pairs:
                if pair.rater_id in excluded_raters:
                    excluded["flagged_rater"] += 1
                    continue
                split = "test" if heldout(pair.comparison_id, heldout_fraction) else "train"
                line = json.dumps(
                    {
                        "chosen": transcript(pair.prompt, pair.chosen),
                        "rejected": transcript(pair.prompt, pair.rejected),
                        "comparison_id": pair.comparison_id,
                        "preference_id": pair.preference_id,
                        "rater_id": pair.rater_id,
                        "weight": weights.get(pair.rater_id, 1.0),
                    },
                    ensure_ascii=False,
                    sort_keys=True,
                ).encode()
                (test if split == "test" else train).write(line + b"\n")
                digest.update(split.encode() + line)
                counts[split] += 1
                last = max(last, pair.recorded_at)
        # 3. Manifest and publish.
        manifest = SnapshotManifest(
            snapshot_id=f"snap-{digest.hexdigest()[:16]}",
            format=SNAPSHOT_FORMAT,
            train_pairs=counts["train"],
            test_pairs=counts["test"],
            heldout_fraction=heldout_fraction,
            last_recorded_at=last,
            excluded_raters=dict(sorted(excluded_raters.items())),
            excluded=dict(sorted(excluded.items())),
        )
        (tmp / "manifest.json").write_text(json.dumps(asdict(manifest), indent=2, sort_keys=True) + "\n")
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest
