"""The sweep benchmark's ASHA side runs trials as a parallel sweep does: up to ``concurrency`` in
flight, advanced in lockstep, judged by the kit's ASHA rule in the order they report. A fake
trainer replays scripted curves, so the schedule and the promotions are exact."""

from __future__ import annotations

import pytest
import torch

from forge_experiments.earlystop import Asha, AshaPromotion
from forge_experiments.sweepspace import parse
from forge_training.bench.sweep import Judge, Trial, in_order, replayer, run_asha, run_interleaved

# val_loss at steps 1, 3, 9 (rungs 1 and 3 of min_steps 1, eta 3, max_steps 9). Trial 0 leads at
# step 1 and ends worst; trial 3 is last at step 1, already best at step 3, and best at the end.
CURVES = {
    0: [(1, 4.0), (3, 3.9), (9, 3.8)],
    1: [(1, 4.2), (3, 3.6), (9, 3.3)],
    2: [(1, 4.3), (3, 3.7), (9, 3.4)],
    3: [(1, 4.4), (3, 3.5), (9, 3.1)],
    4: [(1, 4.1), (3, 3.8), (9, 3.5)],
    5: [(1, 4.5), (3, 3.95), (9, 3.6)],
}


def _run(concurrency: int, grace: int = 1) -> tuple[list[tuple[int, int]], list[Trial], Asha]:
    """Replay ``CURVES`` (the points at multiples of ``grace``) through the interleaved schedule and
    the kit's ASHA rule with rungs from ``grace``; (reports in order, trials, the rule)."""
    reports: list[tuple[int, int]] = []
    trials = [Trial(i, {}, None) for i in CURVES]
    rule = Asha(min_steps=grace, eta=3, max_steps=9)

    def judge(index: int, step: int, value: float) -> bool:
        reports.append((index, step))
        return rule.report(str(index), step, value) != "stop"

    def run_one(trial: Trial, on_value: Judge) -> None:
        for step, value in CURVES[trial.index]:
            if step % grace:
                continue
            trial.steps = step
            trial.curve.append((step, value))
            if not on_value(step, value):
                trial.stopped_at, trial.steps = step, step + 1
                return
        trial.final = trial.curve[-1][1]

    run_interleaved(in_order(trials), concurrency, judge, run_one)
    return reports, trials, rule


def test_in_flight_trials_report_rung_by_rung_and_a_freed_slot_takes_the_next_trial() -> None:
    reports, trials, rule = _run(concurrency=3)
    # Trials 0-2 reach rung 1 together; 1 and 2 lose to 0 there and free their slots, which
    # trials 3 and 4 take at the next round, while 0 goes on to rung 3.
    assert reports[:3] == [(0, 1), (1, 1), (2, 1)]
    assert reports[3:6] == [(0, 3), (3, 1), (4, 1)]
    # One after another, trial 0 would run to its end before trial 1 reports at all.
    sequential, _, _ = _run(concurrency=1)
    assert sequential[:3] == [(0, 1), (0, 3), (0, 9)]
    # Both schedules feed the same rule; at equal step speed each rung sees trials arrive in the
    # order they started, so the decisions agree (the rule is asynchronous by design).
    assert {t.index: t.stopped_at for t in trials} == {t.index: t.stopped_at for t in _run(1)[1]}
    assert rule.occupancy() == {1: 6, 3: 1}


def test_a_rung_before_the_ranking_settles_stops_the_winner_and_a_grace_period_keeps_it() -> None:
    _, trials, _ = _run(concurrency=3, grace=1)
    finished = {t.index: t.final for t in trials if t.final is not None}
    assert 3 not in finished and trials[3].stopped_at == 1  # stopped at step 1, last there
    _, trials, rule = _run(concurrency=3, grace=3)  # one rung, at step 3, where trial 3 leads
    finished = {t.index: t.final for t in trials if t.final is not None}
    assert min(finished.values()) == 3.1 and rule.rungs == [3]
    assert sum(t.steps for t in trials) < 9 * len(trials)


def test_a_failing_trial_is_raised_and_nothing_hangs() -> None:
    trials = [Trial(i, {}, None) for i in range(3)]

    def run_one(trial: Trial, on_value: Judge) -> None:
        on_value(1, 1.0)
        if trial.index == 1:
            raise RuntimeError("diverged")
        on_value(2, 1.0)

    with pytest.raises(RuntimeError, match="diverged"):
        run_interleaved(in_order(trials), 3, None, run_one)


def test_each_trial_draws_the_random_numbers_it_would_draw_alone() -> None:
    def draws(trial: Trial, on_value: Judge) -> None:
        torch.manual_seed(trial.index)
        for step in range(3):
            trial.curve.append((step, float(torch.rand(1))))
            on_value(step, 0.0)

    alone = [Trial(i, {}, None) for i in range(2)]
    run_interleaved(in_order(alone), 1, None, draws)
    together = [Trial(i, {}, None) for i in range(2)]
    run_interleaved(in_order(together), 2, None, draws)
    assert [t.curve for t in together] == [t.curve for t in alone]


def test_the_promotion_form_resumes_paused_trials_and_spends_fewer_steps_than_the_stopping_form() -> None:
    """One rung, at step 3 (values 0: 3.9, 1: 3.6, 2: 3.7, 3: 3.5, 4: 3.8, 5: 3.95). Stopping form:
    0 and 1 go on (first at the rung; best of two), 2 stops, 3 goes on (best of four), 4 and 5 stop:
    three trials to the end, 3 x 9 + 3 x 4 = 39 steps. Promotion form: a trial pauses at step 3
    unless it is in the top n // 3 of its rung: 0 and 1 pause (too few values), 2 pauses and its
    slot resumes 1 (best of three), 3 goes on at once (best of four), 4 and 5 pause: two trials to
    the end, 2 x 9 + 4 x 4 = 34 steps, the same winner."""
    _, stopping, _ = _run(concurrency=3, grace=3)
    assert sum(t.steps for t in stopping) == 39
    rule = AshaPromotion(min_steps=3, eta=3, max_steps=9)
    trials = [Trial(i, {}, None) for i in CURVES]
    by_index = {t.index: t for t in trials}
    fresh = in_order(trials)
    runs: list[int] = []

    def next_job(inflight: list[Trial]) -> Trial | None:
        final_below = 9 if not any(t.steps == 0 for t in trials) and not inflight else 0
        promoted = rule.next_promotion(final_below)
        return by_index[int(promoted[0])] if promoted else fresh(inflight)

    def run_one(trial: Trial, on_value: Judge) -> None:
        runs.append(trial.index)
        for step, value in CURVES[trial.index]:
            if step % 3 or step <= trial.steps:
                continue  # a resumed trial goes on from its checkpoint
            trial.curve.append((step, value))
            trial.steps = step
            if not on_value(step, value):
                trial.steps = step + 1
                return
        trial.final = trial.curve[-1][1]

    run_interleaved(
        next_job, 3, lambda i, step, value: rule.report(str(i), step, value) not in ("pause", "stop"), run_one
    )
    assert {t.index for t in trials if t.final is not None} == {1, 3}
    assert min(t.final for t in trials if t.final is not None) == 3.1
    assert sum(t.steps for t in trials) == 34 and sorted(runs) == [0, 1, 1, 2, 3, 4, 5]


COOLED_SPACE = """
name: replay
recipe: smoke
metric: {name: val_loss, mode: min}
sampler: grid
seed: 0
parameters:
  optim.lr: {type: categorical, values: [0.001, 0.002, 0.003, 0.004, 0.005, 0.006]}
gpu_type: SIM
budget: {trials: 6, gpu_hours: 1, max_steps: 9}
concurrency: 1
early_stopping: {rule: asha, min_steps: 3, eta: 3, rung_eval: cooldown, cooldown_fraction: 0.5}
"""


def test_cooldown_rungs_judge_the_branch_values_and_count_the_branch_steps() -> None:
    """One rung, at step 3 (a branch of ceil(0.5 x 3) = 2 steps). By the run's own values trial 3
    is last at step 3 (its high rate's noise) and never promoted; after the branch it is first,
    and it is the one that ends best. Every trial pays its branch: 6 x 2 steps on top of the run's."""
    plain = {0: 3.5, 1: 3.6, 2: 3.7, 3: 3.95, 4: 3.8, 5: 3.9}
    final = {0: 3.6, 1: 3.4, 2: 3.5, 3: 3.1, 4: 3.3, 5: 3.7}
    curves = {i: [(3, plain[i]), (9, final[i])] for i in plain}
    cooled = {0: {3: 3.8}, 1: {3: 3.5}, 2: {3: 3.6}, 3: {3: 3.0}, 4: {3: 3.7}, 5: {3: 3.9}}
    space = parse(COOLED_SPACE)
    plan = [(params, None) for params in space.configurations()]
    plain_space = parse(COOLED_SPACE.replace(", rung_eval: cooldown, cooldown_fraction: 0.5", ""))
    by_value, _, _ = run_asha(plain_space, plan, 3, replayer(plain_space, curves))
    assert 3 not in {t.index for t in by_value if t.final is not None}
    assert all(t.branch_steps == 0 for t in by_value)
    by_branch, rule, _ = run_asha(space, plan, 3, replayer(space, curves, cooled))
    finished = {t.index: t.final for t in by_branch if t.final is not None}
    assert min(finished.values()) == 3.1 and 3 in finished
    assert rule.recorded[3] == {str(i): v[3] for i, v in cooled.items()}  # the branch values only
    assert all(t.branch_steps == 2 and t.rung_values == [(3, cooled[t.index][3])] for t in by_branch)
    own = sum(9 if t.final is not None else 4 for t in by_branch)  # a paused trial stops at step 4
    assert sum(t.steps for t in by_branch) == own + 6 * 2
