"""The mSPRT's error rates by simulation (seeded), and the canary analysis on simulated traffic."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import numpy as np
import pytest

from forge_experiments.canary import (
    CanaryPolicy,
    Outcome,
    analyze,
    counts_of,
    federation_url,
    load_policy,
    parse_metrics,
)
from forge_experiments.sequential import Arm, compare_rates, mixture_lr
from forge_kit import errors

REPS = 600
LOOKS = 60
PER_LOOK = 25  # requests per arm between looks


def simulate(
    p_canary: float, p_production: float, *, margin: float, harm_margin: float, tau: float, seed: int
):
    """Per repetition: did the harm test ever reject at 0.05, did non-inferiority ever reject."""
    rng = np.random.default_rng(seed)
    canary = rng.binomial(PER_LOOK, p_canary, size=(REPS, LOOKS)).cumsum(axis=1)
    production = rng.binomial(PER_LOOK, p_production, size=(REPS, LOOKS)).cumsum(axis=1)
    harm = noninf = 0
    for r in range(REPS):
        prev = (1.0, 1.0)
        hit_harm = hit_noninf = False
        for look in range(LOOKS):
            n = PER_LOOK * (look + 1)
            test = compare_rates(
                Arm(n, int(canary[r, look])),
                Arm(n, int(production[r, look])),
                margin=margin,
                harm_margin=harm_margin,
                tau=tau,
                previous=prev,
            )
            prev = (test.harm_p, test.noninf_p)
            hit_harm = hit_harm or test.harm_p <= 0.05
            hit_noninf = hit_noninf or test.noninf_p <= 0.05
        harm += hit_harm
        noninf += hit_noninf
    return harm / REPS, noninf / REPS


def test_harm_test_keeps_its_type_one_error_under_continuous_peeking() -> None:
    # Identical arms, looked at 60 times: a fixed-n z-test peeked at this often rejects far more
    # than 5 %; the always-valid p-value must not (3 standard errors of slack for 600 reps).
    false_harm, _ = simulate(0.03, 0.03, margin=0.02, harm_margin=0.0, tau=0.05, seed=1)
    assert false_harm <= 0.05 + 3 * (0.05 * 0.95 / REPS) ** 0.5


def test_noninferiority_keeps_its_error_when_the_canary_is_worse_by_the_margin() -> None:
    _, false_promote = simulate(0.05, 0.03, margin=0.02, harm_margin=0.0, tau=0.05, seed=2)
    assert false_promote <= 0.05 + 3 * (0.05 * 0.95 / REPS) ** 0.5


def test_both_directions_have_power() -> None:
    harm, _ = simulate(0.05, 0.0, margin=0.02, harm_margin=0.0, tau=0.05, seed=3)
    _, promote = simulate(0.0, 0.0, margin=0.02, harm_margin=0.0, tau=0.05, seed=4)
    assert harm >= 0.95
    assert promote >= 0.95


def test_mixture_likelihood_ratio_is_one_without_evidence() -> None:
    assert mixture_lr(0.1, 0.0, 0.0, 0.1) == 1.0
    assert mixture_lr(0.0, 0.01, 0.0, 0.1) < 1.0  # no difference: evidence for H0
    with pytest.raises(ValueError, match="0 <= k <= n"):
        Arm(3, 4)


POLICY = CanaryPolicy.model_validate(
    {
        "family": "sim",
        "version": 1,
        "window_s": 60,
        "interval_s": 2,
        "extension_s": 20,
        "max_extensions": 1,
        "min_requests": 150,
        "metrics": {
            "errors": {"margin": 0.02, "tau": 0.1},
            "ttft_p95": {"margin": 0.10, "harm_margin": 0.03, "tau": 0.10},
            "itl_p95": {"margin": 0.10, "harm_margin": 0.03, "tau": 0.10},
            "empty_answers": {"margin": 0.05, "harm_margin": 0.02, "tau": 0.05},
        },
    }
)


def traffic(rng: np.random.Generator, n: int, *, error: float = 0.0, slow: float = 1.0) -> list[Outcome]:
    ttft = rng.lognormal(np.log(0.04), 0.25, n) * slow
    itl = rng.lognormal(np.log(0.01), 0.2, n) * slow
    failed = rng.random(n) < error
    return [
        Outcome("500") if f else Outcome("200", float(t), float(i), False)
        for f, t, i in zip(failed, ttft, itl, strict=True)
    ]


def run_canary(seed: int, *, error: float = 0.0, slow: float = 1.0, rate: float = 5.0) -> tuple[str, float]:
    """Looks every interval at ``rate`` requests/s per arm until a decision; (decision, seconds)."""
    rng = np.random.default_rng(seed)
    canary: list[Outcome] = []
    production: list[Outcome] = []
    previous: dict[str, list[float]] = {}
    extensions, t = 0, 0.0
    while True:
        t += POLICY.interval_s
        per = int(rate * POLICY.interval_s)
        canary += traffic(rng, per, error=error, slow=slow)
        production += traffic(rng, per)
        result = analyze(
            counts_of(canary),
            counts_of(production),
            POLICY,
            elapsed_s=t,
            extensions=extensions,
            previous=previous,
        )
        previous = result.p_values()
        if result.decision == "extend":
            extensions += 1
        elif result.decision != "continue":
            return result.decision, t


def test_analysis_promotes_identical_and_rolls_back_errors_and_latency() -> None:
    assert run_canary(10)[0] == "promote"
    assert run_canary(11, error=0.05)[0] == "rollback"
    decision, seconds = run_canary(12, slow=1.5)
    assert decision == "rollback" and seconds <= POLICY.window_s


def test_false_rollback_rate_of_an_identical_canary_is_at_most_five_percent() -> None:
    decisions = [run_canary(100 + seed)[0] for seed in range(60)]
    assert decisions.count("rollback") / len(decisions) <= 0.05


def test_no_traffic_extends_then_never_promotes() -> None:
    empty = counts_of([])
    first = analyze(empty, empty, POLICY, elapsed_s=61, extensions=0)
    assert first.decision == "extend" and "too little traffic" in first.reason
    last = analyze(empty, empty, POLICY, elapsed_s=81, extensions=1)
    assert last.decision == "rollback" and "policy says rollback" in last.reason


def test_a_crashed_canary_replica_is_a_failure_not_missing_data() -> None:
    rng = np.random.default_rng(5)
    production = counts_of(traffic(rng, 40))
    canary = counts_of(traffic(rng, 10) + [Outcome("unavailable")] * 12)
    result = analyze(canary, production, POLICY, elapsed_s=4, extensions=0)
    assert result.decision == "rollback" and "errors" in result.reason


def test_policy_files_are_validated(tmp_path: Path) -> None:
    assert load_policy("anything-unknown").family == "default"
    with pytest.raises(errors.ValidationError, match="canary_policy"):
        load_policy("../etc/passwd")
    (tmp_path / "bad.yaml").write_text("family: bad\nversion: 1\nwindow_s: -1\n")
    with pytest.raises(errors.ValidationError, match=r"bad\.yaml"):
        load_policy("bad", tmp_path)
    (tmp_path / "default.yaml").write_text(": : :\n")
    with pytest.raises(errors.ValidationError, match=r"default\.yaml"):
        load_policy("other", tmp_path)


def test_a_paused_analysis_never_promotes_but_still_rolls_back() -> None:
    rng = np.random.default_rng(6)
    production = counts_of(traffic(rng, 400))
    good = analyze(counts_of(traffic(rng, 400)), production, POLICY, elapsed_s=30, extensions=0)
    assert good.decision == "promote"
    paused = analyze(
        counts_of(traffic(rng, 400)), production, POLICY, elapsed_s=300, extensions=1, paused=True
    )
    assert (paused.decision, paused.reason) == ("continue", "paused by an operator")
    bad = analyze(
        counts_of(traffic(rng, 400, error=0.2)), production, POLICY, elapsed_s=30, extensions=0, paused=True
    )
    assert bad.decision == "rollback"


def test_parsed_counters_sum_every_replicas_series() -> None:
    """Two gateway replicas in one exposition (as Prometheus federates them, each sample labelled
    with its ``instance``): every counter and histogram bucket is the sum of theirs."""
    lines = []
    for instance, (ok, failed, fast) in {"a:8080": (3, 1, 2), "b:8080": (5, 0, 4)}.items():
        at = f'instance="{instance}",model="m:2",split="canary"'
        lines += [
            f'forge_gateway_upstream_requests_total{{{at},status="200"}} {ok} 1700000000000',
            f'forge_gateway_upstream_requests_total{{{at},status="500"}} {failed} 1700000000000',
            f'forge_gateway_time_to_first_token_seconds_bucket{{{at},le="0.1"}} {fast} 1700000000000',
            f'forge_gateway_time_to_first_token_seconds_bucket{{{at},le="+Inf"}} {ok + failed} 1700000000000',
            f"forge_gateway_empty_answers_total{{{at}}} 1 1700000000000",
        ]
    counts = parse_metrics("\n".join(lines) + "\n", [("m:2", "canary")])[("m:2", "canary")]
    assert counts.statuses == {"200": 8.0, "500": 1.0}
    assert counts.ttft == {"0.1": 6.0, "+Inf": 9.0} and counts.empty == 2.0


def test_the_federation_address_asks_for_the_analysis_series_only() -> None:
    url = urlsplit(federation_url("http://prometheus.monitoring.svc:9090/"))
    assert (url.scheme, url.netloc, url.path) == ("http", "prometheus.monitoring.svc:9090", "/federate")
    (match,) = parse_qs(url.query)["match[]"]
    assert match.startswith('{__name__=~"') and match.endswith('"}')
    names = match[len('{__name__=~"') : -2].split("|")
    assert sorted(names) == sorted(
        [
            "forge_gateway_upstream_requests_total",
            "forge_gateway_time_to_first_token_seconds_bucket",
            "forge_gateway_inter_token_latency_seconds_bucket",
            "forge_gateway_empty_answers_total",
        ]
    )
