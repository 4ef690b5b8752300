"""The CPT search space, selection rule, paired measurements, Pareto front and report."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from forge_experiments import cptmix, cptreport, sweepspace
from forge_kit.errors import ValidationError


def point(
    label: str, gain: float, forgetting: float, half: float = 0.01, stage: str = "search"
) -> cptmix.Point:
    return cptmix.Point(
        label=label,
        general_fraction=0.1,
        lr=1e-3,
        steps=10,
        domain_loss=3.0 - gain,
        domain_ci95=[2.9 - gain, 3.1 - gain],
        general_loss=2.0 + forgetting,
        general_ci95=[1.9 + forgetting, 2.1 + forgetting],
        domain_gain=gain,
        domain_gain_ci95=[gain - half, gain + half],
        forgetting=forgetting,
        forgetting_ci95=[forgetting - half, forgetting + half],
        stage=stage,
    )


def test_pareto_front_keeps_only_undominated_points_ordered_by_forgetting() -> None:
    points = [
        point("a", 0.10, 0.00),
        point("b", 0.30, 0.05),
        point("c", 0.20, 0.06),  # dominated by b: less gain, more forgetting
        point("d", 0.50, 0.20),
        point("e", 0.50, 0.25),  # dominated by d: same gain, more forgetting
    ]
    assert cptmix.pareto_front(points) == [0, 1, 3]
    assert cptmix.dominates(points[1], points[2]) and not cptmix.dominates(points[0], points[1])


def test_rule_chooses_the_largest_gain_within_the_forgetting_limit_judged_on_the_interval() -> None:
    points = [point("a", 0.10, 0.00), point("b", 0.30, 0.045), point("d", 0.50, 0.20)]
    # b's forgetting is 0.045 but its interval reaches 0.055: the interval rule refuses it.
    chosen = cptmix.select(points, cptmix.Rule(max_forgetting=0.05, bound="interval"))
    assert chosen.chosen == 0 and chosen.admissible == [0]
    assert "a: the largest domain gain" in chosen.reason
    by_point = cptmix.select(points, cptmix.Rule(max_forgetting=0.05, bound="point"))
    assert by_point.chosen == 1 and by_point.admissible == [0, 1]
    loose = cptmix.select(points, cptmix.Rule(max_forgetting=1.0))
    assert loose.chosen == 2
    # A minimum domain gain removes points too.
    assert cptmix.select(points, cptmix.Rule(max_forgetting=1.0, min_domain_gain=0.6)).chosen is None


def test_no_admissible_point_chooses_nothing_and_says_by_how_much_the_best_missed() -> None:
    points = [point("a", 0.10, 0.08), point("b", 0.30, 0.20)]
    selection = cptmix.select(points, cptmix.Rule(max_forgetting=0.05))
    assert selection.chosen is None and selection.admissible == []
    assert selection.front == [0, 1]
    assert "no checkpoint meets the rule" in selection.reason and "0.0900 (a" in selection.reason
    summary = cptmix.summary(points, cptmix.Rule(max_forgetting=0.05), {"label": "base"})
    assert summary["outcome"] == "none_admissible" and summary["chosen"] is None
    assert not any(r["chosen"] for r in summary["curve"])
    assert cptmix.select([], cptmix.Rule()).chosen is None


def test_ties_prefer_less_forgetting_then_the_final_run() -> None:
    points = [point("s", 0.3, 0.01), point("f", 0.3, 0.01, stage="final"), point("t", 0.3, 0.02)]
    assert cptmix.select(points, cptmix.Rule(max_forgetting=0.5)).chosen == 1


def test_a_point_without_figures_is_refused() -> None:
    with pytest.raises(ValueError, match="no forgetting"):
        cptmix.select([point("a", 0.1, float("nan"))], cptmix.Rule())


def test_paired_point_measures_differences_on_the_same_documents() -> None:
    rng = np.random.default_rng(0)
    base_domain = rng.normal(3.0, 0.5, 200).tolist()
    base_general = rng.normal(2.0, 0.5, 200).tolist()
    # The checkpoint is 0.2 better on every domain document and 0.05 worse on every general one:
    # the documents vary far more than that, but the paired intervals are tight around the shifts.
    p = cptmix.paired_point(
        "x",
        0.05,
        1e-3,
        100,
        base_domain=base_domain,
        domain=(np.asarray(base_domain) - 0.2 + rng.normal(0, 0.01, 200)).tolist(),
        base_general=base_general,
        general=(np.asarray(base_general) + 0.05 + rng.normal(0, 0.01, 200)).tolist(),
    )
    assert p.domain_gain == pytest.approx(0.2, abs=0.005)
    assert p.forgetting == pytest.approx(0.05, abs=0.005)
    assert p.domain_gain_ci95[0] < p.domain_gain < p.domain_gain_ci95[1]
    assert p.forgetting_ci95[1] - p.forgetting_ci95[0] < 0.01
    # The loss itself has the documents' spread in its interval, far wider.
    assert p.general_ci95[1] - p.general_ci95[0] > 0.1
    assert p.n_domain == p.n_general == 200
    with pytest.raises(ValueError, match="same length"):
        cptmix.paired_point(
            "y", 0.1, 1e-3, 1, base_domain=[1.0], domain=[1.0, 2.0], base_general=[1.0], general=[1.0]
        )


def test_compared_point_turns_an_evaluators_deltas_into_gain_and_forgetting() -> None:
    p = cptmix.compared_point(
        "x",
        0.1,
        1e-3,
        5,
        domain=cptmix.Loss(1.5, (1.4, 1.6), 30),
        general=cptmix.Loss(2.2, (2.1, 2.3), 40),
        domain_delta=(-0.3, -0.35, -0.25),
        general_delta=(0.04, 0.01, 0.07),
    )
    assert p.domain_gain == pytest.approx(0.3) and p.domain_gain_ci95 == pytest.approx([0.25, 0.35])
    assert p.forgetting == 0.04 and p.forgetting_ci95 == [0.01, 0.07]


@pytest.mark.parametrize(
    ("space", "field"),
    [
        (cptmix.SearchSpace((), (1e-3,)), "search.general_fractions"),
        (cptmix.SearchSpace((0.1, 0.1), (1e-3,)), "search.general_fractions"),
        (cptmix.SearchSpace((0.0,), (1e-3,)), "search.general_fractions[0]"),
        (cptmix.SearchSpace((1.0,), (1e-3,)), "search.general_fractions[0]"),
        (cptmix.SearchSpace((0.1,), (1e-3, float("nan"))), "search.peak_lrs[1]"),
        (cptmix.SearchSpace((0.1,), (-1e-3,)), "search.peak_lrs[0]"),
        (cptmix.SearchSpace((0.1,), (1e-3,), warmup_fraction=0.9), "search.warmup_fraction"),
        (cptmix.SearchSpace((0.1,), (1e-3,), min_lr=1e-3), "search.min_lr"),
        (cptmix.SearchSpace((0.1,), (1e-3,), schedule="linear"), "search.schedule"),
        (
            cptmix.SearchSpace(tuple(i / 20 for i in range(1, 10)), tuple(i / 1000 for i in range(1, 10))),
            "search",
        ),
    ],
)
def test_bad_search_spaces_are_refused_naming_the_field(space: cptmix.SearchSpace, field: str) -> None:
    with pytest.raises(ValidationError) as exc:
        space.validate()
    assert exc.value.field == field


@pytest.mark.parametrize(
    ("rule", "field"),
    [
        (cptmix.Rule(max_forgetting=-0.1), "rule.max_forgetting"),
        (cptmix.Rule(max_forgetting=float("inf")), "rule.max_forgetting"),
        (cptmix.Rule(min_domain_gain=float("nan")), "rule.min_domain_gain"),
        (cptmix.Rule(bound="mean"), "rule.bound"),
    ],
)
def test_bad_rules_are_refused_naming_the_field(rule: cptmix.Rule, field: str) -> None:
    with pytest.raises(ValidationError) as exc:
        rule.validate()
    assert exc.value.field == field


def test_each_fractions_sweep_space_is_a_valid_sweep_with_the_rewarm_and_redecay_schedule() -> None:
    search = cptmix.SearchSpace((0.05, 0.25), (1e-3, 3e-3), warmup_fraction=0.1, min_lr=1e-4).validate()
    assert search.grid() == [(0.05, 1e-3), (0.05, 3e-3), (0.25, 1e-3), (0.25, 3e-3)]
    data = cptmix.sweep_space(
        search,
        0.25,
        name="cpt-x-f1",
        recipe="cpt_scifact",
        steps=90,
        fixed={"init.parent": "/models/base", "eval_batches": 4},
        early_stopping={"rule": "asha", "min_steps": 30, "eta": 3},
        team="research",
        concurrency=2,
        gpu_hours=1.0,
    )
    space = sweepspace.parse(json.dumps(data))  # YAML is a superset of JSON
    assert space.metric == "val_loss" and space.mode == "min" and space.rungs() == [30]
    overrides = space.trial_overrides(space.grid()[1])
    assert overrides["optim.lr"] == 3e-3 and overrides["mixture.general_fraction"] == 0.25
    assert overrides["optim.warmup_steps"] == 9 and overrides["optim.min_lr"] == 1e-4
    assert overrides["optim.schedule"] == "cosine" and overrides["max_steps"] == 90
    assert overrides["init.parent"] == "/models/base"


def test_report_writes_the_curve_table_the_reason_and_the_plot(tmp_path: Path) -> None:
    points = [point("a", 0.10, 0.00), point("b", 0.30, 0.04), point("f", 0.35, 0.045, stage="final")]
    summary = cptmix.summary(
        points,
        cptmix.Rule(max_forgetting=0.05, bound="point"),
        {"label": "base", "domain_loss": 3.0, "general_loss": 2.0},
    )
    md, png = cptreport.write(summary, tmp_path)
    text = md.read_text()
    assert "**Chosen**: f: the largest domain gain" in text and "| final |" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
