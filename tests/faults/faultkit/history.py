"""Histories of client operations and the checks run on them after the faults heal (Jepsen-style).

Each client records every operation it tries as an ``invoke`` followed by exactly one outcome:
``ok`` (the service acknowledged it), ``fail`` (the service refused it clearly: the error says
so, and nothing was applied) or ``info`` (no answer: it may or may not have been applied, e.g. a
deadline passed). A retried request is invoked again with the same key.

After the heal the test reads what the system holds (``applied``: key → how many times it is
there) and the checks below compare the two. Every check returns :class:`Anomaly` values naming
the operations at fault; :meth:`Verdict.assert_valid` fails with all of them listed.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

OpType = Literal["invoke", "ok", "fail", "info"]
TERMINAL_JOB_STATES = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})


@dataclass(frozen=True)
class Op:
    index: int
    process: str  # the client that did it
    type: OpType
    f: str  # what it did: "write", "submit", "promote", ...
    key: str  # what it is about: a preference id, a job id, a request's idempotency key
    value: Any = None
    error: str = ""
    time: float = 0.0

    def __str__(self) -> str:
        said = f" {self.value!r}" if self.value is not None else ""
        why = f" ({self.error})" if self.error else ""
        return f"#{self.index} {self.process} {self.type} {self.f} {self.key}{said}{why} at {self.time:.2f}s"


class History:
    """An append-only, thread-safe log of operations."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self._lock = threading.Lock()
        self._start = time.monotonic()

    def _add(self, process: str, type_: OpType, f: str, key: str, value: Any, error: str) -> Op:
        with self._lock:
            op = Op(len(self.ops), process, type_, f, key, value, error, time.monotonic() - self._start)
            self.ops.append(op)
        return op

    def invoke(self, process: str, f: str, key: str, value: Any = None) -> Op:
        return self._add(process, "invoke", f, key, value, "")

    def ok(self, invoked: Op, value: Any = None) -> Op:
        return self._add(invoked.process, "ok", invoked.f, invoked.key, value, "")

    def fail(self, invoked: Op, error: str) -> Op:
        """A clear refusal: ``error`` must say what was refused (a status code and a message)."""
        if not error.strip():
            raise ValueError("a fail needs the error the service gave")
        return self._add(invoked.process, "fail", invoked.f, invoked.key, None, error)

    def info(self, invoked: Op, error: str) -> Op:
        return self._add(invoked.process, "info", invoked.f, invoked.key, None, error or "no answer")

    def of(self, f: str) -> list[Op]:
        return [op for op in self.ops if op.f == f]

    def dump(self, path: Path) -> None:
        path.write_text("".join(json.dumps(asdict(op), default=str) + "\n" for op in self.ops))

    @staticmethod
    def load(path: Path) -> History:
        history = History()
        history.ops = [Op(**json.loads(line)) for line in path.read_text().splitlines() if line]
        return history


@dataclass(frozen=True)
class Anomaly:
    kind: str
    key: str
    detail: str
    ops: tuple[Op, ...] = ()

    def __str__(self) -> str:
        named = "".join(f"\n    {op}" for op in self.ops)
        return f"{self.kind}: {self.key}: {self.detail}{named}"


@dataclass
class Verdict:
    ops_checked: int
    anomalies: list[Anomaly] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.anomalies

    def kinds(self) -> dict[str, list[str]]:
        found: dict[str, list[str]] = defaultdict(list)
        for anomaly in self.anomalies:
            found[anomaly.kind].append(anomaly.key)
        return dict(found)

    def assert_valid(self) -> None:
        if self.anomalies:
            lines = "\n".join(f"  {a}" for a in self.anomalies)
            raise AssertionError(
                f"history check failed: {len(self.anomalies)} anomalies in {self.ops_checked} operations\n{lines}"
            )


def _by_key(ops: Iterable[Op]) -> dict[str, list[Op]]:
    grouped: dict[str, list[Op]] = defaultdict(list)
    for op in ops:
        grouped[op.key].append(op)
    return grouped


def check_writes(
    history: History, f: str, applied: Mapping[str, int], *, where: str = "the store"
) -> list[Anomaly]:
    """Writes ``f`` against what ``where`` holds after the heal (key → copies):

    * ``lost``: acknowledged (``ok``) but not there;
    * ``duplicated``: there more than once;
    * ``phantom``: there although never invoked, or although every attempt was refused (``fail``);
    * ``unanswered-retry``: invoked more than once and the client never got an answer it could
      act on (its last attempt ended ``info``) — a retried request must end done or refused.
    """
    anomalies: list[Anomaly] = []
    grouped = _by_key(history.of(f))
    for key, ops in sorted(grouped.items()):
        outcomes = [op for op in ops if op.type != "invoke"]
        copies = applied.get(key, 0)
        if copies == 0 and any(op.type == "ok" for op in outcomes):
            anomalies.append(Anomaly("lost", key, f"acknowledged but not in {where}", tuple(ops)))
        if copies > 1:
            anomalies.append(Anomaly("duplicated", key, f"{copies} copies in {where}", tuple(ops)))
        if copies and outcomes and all(op.type == "fail" for op in outcomes):
            anomalies.append(Anomaly("phantom", key, f"refused every time yet in {where}", tuple(ops)))
        invokes = [op for op in ops if op.type == "invoke"]
        if len(invokes) > 1 and (not outcomes or outcomes[-1].type == "info"):
            anomalies.append(
                Anomaly(
                    "unanswered-retry", key, f"tried {len(invokes)} times, last without an answer", tuple(ops)
                )
            )
    for key in sorted(set(applied) - set(grouped)):
        if applied[key]:
            anomalies.append(Anomaly("phantom", key, f"in {where} but never written by a client"))
    return anomalies


def check_copies(source: Mapping[str, int], copy: Mapping[str, int], *, what: str) -> list[Anomaly]:
    """Every key of ``source`` (e.g. the owner's database) also in ``copy`` (e.g. a consumer's
    view), once: ``lost-in-copy`` and ``duplicated-in-copy`` name the keys, whether or not their
    writer ever heard back (a write applied after its client gave up must flow on all the same)."""
    anomalies: list[Anomaly] = []
    for key in sorted(source):
        if source[key] and not copy.get(key):
            anomalies.append(Anomaly("lost-in-copy", key, f"in the source but not in {what}"))
        elif copy.get(key, 0) > 1:
            anomalies.append(Anomaly("duplicated-in-copy", key, f"{copy[key]} times in {what}"))
    return anomalies


def check_jobs(
    history: History, f: str, final_states: Mapping[str, Iterable[str]], runs: Mapping[str, Iterable[str]]
) -> list[Anomaly]:
    """Jobs submitted with ``f``: ``final_states`` — job → every terminal state it was ever
    reported in (events, rows); ``runs`` — job → every node on which a run of it did its work to
    the end (a run stopped in time, e.g. requeued after a lost node, is not listed).

    * ``lost``: an acknowledged submission the system does not know;
    * ``two-fates``: reported in more than one terminal state (both succeeded and failed);
    * ``ran-twice``: its work done more than once.
    """
    anomalies: list[Anomaly] = []
    grouped = _by_key(history.of(f))
    for key, ops in sorted(grouped.items()):
        if any(op.type == "ok" for op in ops) and key not in final_states:
            anomalies.append(
                Anomaly("lost", key, "submission acknowledged, job unknown after heal", tuple(ops))
            )
    for job, states in sorted(final_states.items()):
        fates = sorted(set(states) & TERMINAL_JOB_STATES)
        if len(fates) > 1:
            anomalies.append(
                Anomaly("two-fates", job, f"ended {' and '.join(fates)}", tuple(grouped.get(job, ())))
            )
    for job, nodes in sorted(runs.items()):
        started = list(nodes)
        if len(started) > 1:
            anomalies.append(
                Anomaly(
                    "ran-twice", job, f"done {len(started)} times, on {started}", tuple(grouped.get(job, ()))
                )
            )
    return anomalies


def check_aliases(history: History, f: str, aliases: Mapping[str, str]) -> list[Anomaly]:
    """``aliases``: alias → the model version it points at after the heal. An alias may point
    only at a version some promotion (``f``, keyed by version) was acknowledged or left unanswered
    for; one never promoted, or whose every promotion was refused, is named."""
    anomalies: list[Anomaly] = []
    grouped = _by_key(history.of(f))
    for alias, version in sorted(aliases.items()):
        ops = grouped.get(version, [])
        if not any(op.type in ("ok", "info") for op in ops):
            why = "whose every promotion was refused" if ops else "never promoted"
            anomalies.append(Anomaly("unpromoted-alias", alias, f"points at {version}, {why}", tuple(ops)))
    return anomalies


def check_resumes(history: History, f: str, checkpoints: Mapping[str, Mapping[int, str]]) -> list[Anomaly]:
    """Resumes ``f`` (keyed by run, the ``ok`` value the step resumed from) against what the
    store held when each started: ``checkpoints`` — run → step → ``complete`` (manifest and every
    file as listed), ``torn`` (no manifest) or ``corrupt: …`` (a manifest its files belie).

    * ``bad-resume``: resumed from a step that was not a complete checkpoint;
    * ``stale-resume``: resumed from an older step than the newest complete one;
    * ``lost-progress``: started afresh (no ``ok``) although a complete checkpoint was there.
    """
    anomalies: list[Anomaly] = []
    for key, ops in sorted(_by_key(history.of(f)).items()):
        steps = checkpoints.get(key, {})
        newest = max((s for s, state in steps.items() if state == "complete"), default=None)
        for op in ops:
            if op.type != "ok":
                if op.type != "invoke" and newest is not None:
                    anomalies.append(Anomaly("lost-progress", key, f"complete step {newest} not used", (op,)))
                continue
            chosen = int(op.value)
            state = steps.get(chosen, "absent")
            if state != "complete":
                anomalies.append(Anomaly("bad-resume", key, f"resumed from step {chosen}, {state}", (op,)))
            elif newest is not None and chosen < newest:
                anomalies.append(
                    Anomaly(
                        "stale-resume", key, f"resumed from step {chosen}, newest complete {newest}", (op,)
                    )
                )
    return anomalies


def verdict(history: History, *anomaly_lists: list[Anomaly]) -> Verdict:
    return Verdict(len(history.ops), [a for found in anomaly_lists for a in found])
