"""The RLHF loop's decisions as pure functions: the reward-model gate and the drift stops."""

from __future__ import annotations

import math
from typing import Any

import pytest

from forge_kit import errors
from forge_orchestrator.rlhf.model import (
    DriftPoint,
    RlhfInput,
    drift_stop,
    reward_gate,
    rm_version,
    round_gates,
)
from forge_orchestrator.rlhf.worker import validate_rlhf


def point(kl: float, proxy: float, agreement: float) -> DriftPoint:
    return DriftPoint("p", kl, math.sqrt(kl), proxy, agreement)


def test_the_gate_needs_the_interval_above_chance() -> None:
    assert reward_gate({"accuracy": 0.78, "ci95_low": 0.66, "ci95_high": 0.87, "n": 60}) == ""
    refused = reward_gate({"accuracy": 0.64, "ci95_low": 0.48, "ci95_high": 0.77, "n": 39})
    assert "0.640 [0.480, 0.770] on n=39" in refused
    assert "does not beat 50% significantly" in refused
    assert reward_gate(
        {"accuracy": 0.51, "ci95_low": 0.5, "ci95_high": 0.52, "n": 10_000}
    )  # = 0.5 is not above
    assert "no 'n'" in reward_gate({"accuracy": 0.9, "ci95_low": 0.8, "ci95_high": 0.95})


def test_kl_over_budget_stops_the_round() -> None:
    assert drift_stop([point(0, 0.1, 0.5), point(3.9, 0.3, 0.6)], kl_budget=4.0, window=2) == ""
    reason = drift_stop([point(0, 0.1, 0.5), point(4.2, 0.3, 0.6)], kl_budget=4.0, window=2)
    assert reason.startswith("KL to the reference 4.200 nats exceeds the budget 4")


@pytest.mark.parametrize(
    ("points", "stops"),
    [
        # proxy up, agreement down at each of the last two steps: Goodhart
        ([point(0, 0.1, 0.5), point(1, 0.2, 0.45), point(2, 0.3, 0.40)], True),
        # agreement recovers at the last step: keep going
        ([point(0, 0.1, 0.5), point(1, 0.2, 0.45), point(2, 0.3, 0.46)], False),
        # proxy flat at the last step: not "keeps rising"
        ([point(0, 0.1, 0.5), point(1, 0.2, 0.45), point(2, 0.2, 0.40)], False),
        # both rising: the reward model and humans agree
        ([point(0, 0.1, 0.5), point(1, 0.2, 0.55), point(2, 0.3, 0.60)], False),
        # one step only, fewer points than the window needs
        ([point(0, 0.1, 0.5), point(1, 0.2, 0.40)], False),
    ],
)
def test_rising_proxy_with_falling_agreement_stops_the_round(points: list[DriftPoint], stops: bool) -> None:
    reason = drift_stop(points, kl_budget=100.0, window=2)
    assert bool(reason) is stops
    if stops:
        assert (
            reason.startswith("over-optimisation")
            and "sqrt(KL)=1.414: proxy 0.300, agreement 0.400" in reason
        )


def test_reward_model_versions_are_unique_per_round_and_valid() -> None:
    assert rm_version("rlhf:team/x", 2) == "rlhf-team-x.r2"
    assert rm_version("w" * 100, 1) == "w" * 48 + ".r1"


def loop_input(**change: Any) -> RlhfInput:
    return RlhfInput(**{"policy_uri": "/models/sft", "work_uri": "/shared/rlhf", **change})


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"policy_uri": ""}, "input.policy_uri"),
        ({"work_uri": ""}, "input.work_uri"),
        ({"min_new_pairs": 0}, "input.min_new_pairs"),
        ({"poll_s": 700.0}, "input.poll_s"),
        ({"heldout_fraction": 0.0}, "input.heldout_fraction"),
        ({"kl_budget": 0.0}, "input.kl_budget"),
        ({"overopt_window": 0}, "input.overopt_window"),
        ({"dpo_overrides": ["max_steps=3", "no-equals"]}, "input.dpo_overrides[1]"),
        ({"reward_overrides": ["pairs.path=/elsewhere"]}, "input.reward_overrides[0]"),
        ({"rm_min_shorter_low": 1.0}, "input.rm_min_shorter_low"),
        ({"rm_min_shorter_n": 0}, "input.rm_min_shorter_n"),
    ],
)
def test_bad_loop_input_names_the_field(change: dict[str, Any], field: str) -> None:
    validate_rlhf(loop_input())
    with pytest.raises(errors.ValidationError) as caught:
        validate_rlhf(loop_input(**change))
    assert caught.value.field == field


def test_further_round_gates_run_after_the_accuracy_gate() -> None:
    good = {"accuracy": 0.9, "ci95_low": 0.8, "ci95_high": 0.95, "n": 100}
    refuse = lambda summary: "judges length" if "by_length" not in summary else ""  # noqa: E731
    assert reward_gate(good, gates=(refuse,)) == "judges length"
    assert reward_gate({**good, "by_length": {}}, gates=(refuse,)) == ""
    assert reward_gate({**good, "ci95_low": 0.4}, gates=(refuse,)).startswith("held-out pairwise accuracy")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"prompt_dataset": "/etc/passwd"}, "input.prompt_dataset"),
        ({"prompt_dataset": "../../secrets.jsonl"}, "input.prompt_dataset"),
        ({"prompt_dataset": ""}, "input.prompt_dataset"),
        ({"sample_model": "two words"}, "input.sample_model"),
        ({"temperatures": [0.7, 0.7]}, "input.temperatures"),
        ({"temperatures": [0.7]}, "input.temperatures"),
        ({"temperatures": [0.7, 9.0]}, "input.temperatures"),
        ({"dataset_prompts": 5000}, "input.dataset_prompts"),
        ({"dataset_prompts": 0, "production_prompts": 0}, "input.dataset_prompts"),
        ({"min_policy_pairs": 0}, "input.min_policy_pairs"),
        ({"monitor_interval": -1}, "input.monitor_interval"),
        ({"buffer_timeout_s": 0.0}, "input.buffer_timeout_s"),
        ({"dpo_overrides": ["dpo.monitor.out=/etc/x"]}, "input.dpo_overrides[0]"),
    ],
)
def test_online_inputs_are_checked_naming_the_field(change: dict[str, Any], field: str) -> None:
    params = RlhfInput(**{"policy_uri": "/p", "work_uri": "/w", "sample_model": "policy:1", **change})
    with pytest.raises(errors.ValidationError) as caught:
        validate_rlhf(params)
    assert caught.value.field == field


def test_a_well_formed_online_input_passes() -> None:
    validate_rlhf(RlhfInput(policy_uri="/p", work_uri="/w", sample_model="production", monitor_interval=2))


def test_a_round_refuses_a_reward_model_that_judges_length() -> None:
    detector = {
        "accuracy": 0.64,
        "ci95_low": 0.60,
        "ci95_high": 0.68,
        "n": 700,
        "by_length": {
            "unit": "words",
            "preferred_longer": {"accuracy": 0.77, "ci95_low": 0.73, "ci95_high": 0.81, "n": 410},
            "preferred_shorter": {"accuracy": 0.42, "ci95_low": 0.36, "ci95_high": 0.48, "n": 280},
            "tie": {"accuracy": 0.5, "ci95_low": 0.24, "ci95_high": 0.76, "n": 10},
        },
    }
    params = loop_input()
    assert params.rm_length_gate and params.rm_min_shorter_low == 0.5
    assert reward_gate(detector) == ""  # the accuracy gate alone lets it through
    reason = reward_gate(detector, gates=round_gates(params))
    assert reason.startswith("judges length, not quality: accuracy 0.420 [0.360, 0.480]")
    assert reward_gate(detector, gates=round_gates(loop_input(rm_length_gate=False))) == ""
    assert reward_gate(detector, gates=round_gates(loop_input(rm_min_shorter_low=0.3))) == ""  # configurable
    judge = {**detector, "by_length": {**detector["by_length"]}}
    judge["by_length"]["preferred_shorter"] = {
        "accuracy": 0.58,
        "ci95_low": 0.52,
        "ci95_high": 0.64,
        "n": 280,
    }
    assert reward_gate(judge, gates=round_gates(params)) == ""
    no_strata = {k: v for k, v in detector.items() if k != "by_length"}
    assert "no 'by_length'" in reward_gate(no_strata, gates=round_gates(params))


def test_the_round_report_carries_every_field_the_caller_sets_in_the_contract() -> None:
    """The workflow's round record and the feedback service's (``RoundReport``) are each side's own
    type of one proto message, ``RlhfRound``: a field added to the contract must reach both, so
    each side checks its type against the message (the service sets the timestamps)."""
    from dataclasses import fields

    from forge.feedback.v1 import feedback_pb2

    from forge_orchestrator.rlhf.activities import RoundReportInput

    contract = {f.name for f in feedback_pb2.RlhfRound.DESCRIPTOR.fields} - {"started_at", "updated_at"}
    assert {f.name for f in fields(RoundReportInput)} == contract
