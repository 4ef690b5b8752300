"""The history checker on hand-made histories: each anomaly it knows is found and named with the
operations at fault, and valid histories (including unanswered and refused attempts) pass."""

from __future__ import annotations

from pathlib import Path

import pytest
from faultkit.history import (
    History,
    check_aliases,
    check_copies,
    check_jobs,
    check_resumes,
    check_writes,
    verdict,
)


def acked(history: History, process: str, key: str, f: str = "write") -> None:
    history.ok(history.invoke(process, f, key, value=key.upper()))


def test_a_valid_history_passes_with_unanswered_and_refused_attempts() -> None:
    h = History()
    acked(h, "c1", "p1")
    acked(h, "c2", "p2")
    # A timeout, then the retry is acknowledged: done once.
    h.info(h.invoke("c1", "write", "p3"), "DEADLINE_EXCEEDED")
    h.ok(h.invoke("c1", "write", "p3"))
    # Refused clearly twice (a full disk), never applied.
    h.fail(h.invoke("c2", "write", "p4"), "507 disk full")
    h.fail(h.invoke("c2", "write", "p4"), "507 disk full")
    # Unanswered once, not applied: allowed (the client cannot know).
    h.info(h.invoke("c2", "write", "p5"), "connection reset")
    result = verdict(h, check_writes(h, "write", {"p1": 1, "p2": 1, "p3": 1}))
    result.assert_valid()
    assert result.ops_checked == len(h.ops) == 14


def test_lost_duplicated_and_phantom_writes_are_named() -> None:
    h = History()
    acked(h, "c1", "p1")
    acked(h, "c1", "p2")
    acked(h, "c2", "p3")
    h.fail(h.invoke("c2", "write", "p4"), "409 refused")
    result = verdict(h, check_writes(h, "write", {"p1": 1, "p2": 2, "p4": 1, "ghost": 1}, where="Kafka"))
    assert result.kinds() == {"lost": ["p3"], "duplicated": ["p2"], "phantom": ["p4", "ghost"]}
    with pytest.raises(AssertionError) as failed:
        result.assert_valid()
    message = str(failed.value)
    assert "lost: p3: acknowledged but not in Kafka" in message
    assert "#4 c2 invoke write p3 'P3'" in message and "#5 c2 ok write p3" in message  # the ops, named
    assert "duplicated: p2: 2 copies in Kafka" in message


def test_a_retry_that_never_got_an_answer_is_named() -> None:
    h = History()
    h.info(h.invoke("c1", "write", "p1"), "UNAVAILABLE")
    h.info(h.invoke("c1", "write", "p1"), "UNAVAILABLE")
    result = verdict(h, check_writes(h, "write", {"p1": 1}))
    assert result.kinds() == {"unanswered-retry": ["p1"]}


def test_jobs_lost_with_two_fates_or_done_twice() -> None:
    h = History()
    for job in ("j1", "j2", "j3", "j4"):
        acked(h, "submitter", job, f="submit")
    states = {"j1": ["SUCCEEDED"], "j2": ["SUCCEEDED", "FAILED"], "j4": ["FAILED", "FAILED"]}
    runs = {"j1": ["node-a"], "j2": ["node-a"], "j4": ["node-a", "node-b"]}
    result = verdict(h, check_jobs(h, "submit", states, runs))
    assert result.kinds() == {"lost": ["j3"], "two-fates": ["j2"], "ran-twice": ["j4"]}
    assert "ended FAILED and SUCCEEDED" in str(result.anomalies[1])


def test_an_alias_on_a_model_never_promoted_is_named() -> None:
    h = History()
    acked(h, "ops", "llama@3", f="promote")
    h.info(h.invoke("ops", "promote", "llama@4"), "DEADLINE_EXCEEDED")  # may have happened
    h.fail(h.invoke("ops", "promote", "llama@5"), "FAILED_PRECONDITION gate failed")
    aliases = {"prod": "llama@3", "canary": "llama@4", "staging": "llama@5", "shadow": "llama@9"}
    result = verdict(h, check_aliases(h, "promote", aliases))
    assert result.kinds() == {"unpromoted-alias": ["shadow", "staging"]}


def test_a_fail_must_say_why_and_histories_round_trip(tmp_path: Path) -> None:
    h = History()
    with pytest.raises(ValueError):
        h.fail(h.invoke("c1", "write", "p1"), "  ")
    acked(h, "c1", "p2")
    h.dump(tmp_path / "history.jsonl")
    assert History.load(tmp_path / "history.jsonl").ops == h.ops


def test_a_copy_missing_or_repeating_what_the_source_holds_is_named() -> None:
    """A consumer's view against the owner's database: a row whose writer never heard back must
    flow on all the same, and a redelivery must not be applied twice."""
    h = History()
    h.info(h.invoke("c1", "write", "p1"), "timeout")  # applied, the client never knew
    acked(h, "c1", "p2")
    source = {"p1": 1, "p2": 1, "p3": 1}
    copy = {"p2": 2, "p3": 1}
    result = verdict(h, check_copies(source, copy, what="the consumer"))
    assert result.kinds() == {"lost-in-copy": ["p1"], "duplicated-in-copy": ["p2"]}


def test_a_resume_from_a_torn_or_older_checkpoint_is_named() -> None:
    h = History()
    steps = {"run": {10: "complete", 20: "complete", 30: "torn"}}
    h.ok(h.invoke("job", "resume", "run"), 20)
    assert verdict(h, check_resumes(h, "resume", steps)).valid
    h.ok(h.invoke("job", "resume", "run"), 30)
    h.ok(h.invoke("job", "resume", "run"), 10)
    h.info(h.invoke("job", "resume", "run"), "started from step 0")
    result = verdict(h, check_resumes(h, "resume", steps))
    assert result.kinds() == {"bad-resume": ["run"], "stale-resume": ["run"], "lost-progress": ["run"]}
