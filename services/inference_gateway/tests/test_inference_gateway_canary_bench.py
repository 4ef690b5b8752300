"""``forge bench canary``'s preflight: a candidate whose injected fault does not show at the client
is not judged, and the summary says so (the run that promoted a "+50 % latency" candidate whose
delay never reached the client cannot pass unseen)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from forge_experiments.canary import load_policy
from forge_inference_gateway.bench.canary import PRODUCTION, Sent, preflight, summarize


def _arm(arm: str, ttft_ms: float, n: int = 50, errors: int = 0) -> list[Sent]:
    return [
        Sent(arm, "500" if i < errors else "200", None if i < errors else ttft_ms / 1000, 0.01, i * 0.1)
        for i in range(n)
    ]


def test_a_delay_shows_when_the_median_moves_by_half_of_it() -> None:
    seen = preflight("slow", _arm("slow", 180), _arm(PRODUCTION, 100), injected_ms=100)
    assert seen["arms_differ"] is True and seen["injected_ttft_ms"] == 100
    # The old bench's failure: the candidate no slower at the client than production.
    unseen = preflight("slow", _arm("slow", 18.4), _arm(PRODUCTION, 25.3), injected_ms=12)
    assert unseen["arms_differ"] is False


def test_injected_errors_show_when_the_candidate_has_more() -> None:
    assert preflight("errors", _arm("errors", 50, errors=3), _arm(PRODUCTION, 50), 0)["arms_differ"] is True
    assert preflight("errors", _arm("errors", 50), _arm(PRODUCTION, 50), 0)["arms_differ"] is False
    assert preflight("identical", _arm("identical", 50), _arm(PRODUCTION, 50), 0)["arms_differ"] is None


def test_an_unjudged_candidate_fails_its_target_and_the_faults_check() -> None:
    policy = load_policy("bench")

    def client(arm: str) -> list[dict[str, object]]:
        return [asdict(s) for s in _arm(arm, 50) + _arm(PRODUCTION, 50)]

    judged: dict[str, Any] = {
        "decision": "promote",
        "decided_after_s": 30.0,
        "requests_seen": 50,
        "production_requests_seen": 50,
        "reason": "no worse",
        "evidence": {},
        "client": client("identical"),
        "preflight": preflight("identical", _arm("identical", 50), _arm(PRODUCTION, 50), 0),
    }
    unseen = preflight("slow", _arm("slow", 18.4), _arm(PRODUCTION, 25.3), injected_ms=12)
    runs: dict[str, dict[str, Any]] = {
        "identical": judged,
        "errors": {**judged, "decision": "rollback", "client": client("errors")},
        "slow": {"decision": "arms_not_different", "preflight": unseen, "client": []},
    }
    args = {"out": "/tmp/x", "rate": 10.0, "repetitions": 3, "seed": 0, "slowdown": 0.5, "max_tokens": 8}
    summary = summarize(runs, policy, args)
    slow = summary["candidates"]["slow"]
    assert slow["decision"] == "arms_not_different" and slow["requests_seen"] == 0
    met = summary["targets_met"]
    assert met["slow_rolled_back"] is False and met["faults_reached_client"] is False
    assert met["identical_promoted"] is True
