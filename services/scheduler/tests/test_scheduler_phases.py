"""The cycle's phases one at a time (nominate, order, admit, place, backfill, preempt, reserve, jobs
without GPUs), each over a context built from a small snapshot, and the starvation bound: a big
job that small jobs keep passing starts once it has waited the starvation threshold."""

from __future__ import annotations

from dataclasses import replace

from builders import make_cluster, make_pjob, make_teams

from forge_scheduler.policy import Entry, EntryStatus, PolicyConfig, PolicyEngine, Snapshot, Team
from forge_scheduler.policy.engine import admit, nominate, place, place_without_gpus
from forge_scheduler.policy.model import Node
from forge_scheduler.policy.order import order, starving
from forge_scheduler.policy.preemption import preempt
from forge_scheduler.policy.reservation import backfill, reserve

TEAMS = make_teams("research", "product", guaranteed=8)
HOUR = 3600.0


def ctx_of(pending=(), running=(), nodes=None, teams=TEAMS, now=1000.0, config=None):  # type: ignore[no-untyped-def]
    snap = Snapshot(nodes or make_cluster(nodes=2), teams, list(pending), list(running))
    return nominate(config or PolicyConfig(), snap, now)


def test_nominate_indexes_free_gpus_held_quota_and_busy_nodes() -> None:
    nodes = [*make_cluster(nodes=2, inference_pool=1), Node("cpu", 0, "")]
    run = make_pjob("r", "research").gpus(3).running([("n0", 3)])
    ctx = ctx_of(running=[run], nodes=nodes)
    assert ctx.general.free == {"n0": 5}  # the pool node and the GPU-less node are elsewhere
    assert ctx.pool.free == {"n1": 8}
    assert ctx.capacity == {"H100": 16}
    assert ctx.held == {("research", "H100"): 3}
    assert ctx.busy == {"n0": 1}
    assert not ctx.quota.within_guarantee(TEAMS["research"], "H100", 6)


def test_order_puts_a_starving_job_first_in_its_class_longest_wait_first() -> None:
    now = 20 * HOUR
    fresh = make_pjob("fresh", "product").gpus(1).submitted(now - 60).pending()
    # ran 8 GPU-h (tier 1), back in the queue 13 h / 18 h ago: starving (aging alone: tier 0 after 6 h)
    old = make_pjob("old", "research").gpus(8).submitted(0.0).pending(8 * HOUR, now - 13 * HOUR)
    older = make_pjob("older", "research").gpus(8).submitted(0.0).pending(8 * HOUR, now - 18 * HOUR)
    urgent = make_pjob("urgent", "product").gpus(1).priority("high").submitted(now).pending()
    config = replace(PolicyConfig(), starvation_s=12 * HOUR)
    # research holds GPUs, so its fair score puts it after product within a tier
    held = make_pjob("held", "research").gpus(8).running([("n0", 8)])
    ctx = ctx_of(now=now, running=[held])
    _, ids = order(config, ctx.snap, [fresh, old, older, urgent], now, ctx.capacity, ctx.held)
    assert ids == ["urgent", "older", "old", "fresh"]
    assert starving(config, old, now) and not starving(config, fresh, now)
    # without the threshold the fair score puts the aged tier-0 research jobs after product's
    off = replace(config, starvation_s=None)
    _, ids = order(off, ctx.snap, [fresh, old, older, urgent], now, ctx.capacity, ctx.held)
    assert ids == ["urgent", "fresh", "older", "old"]


def test_admit_names_an_unknown_team_and_exhausted_quota_and_asks_none_for_no_gpus() -> None:
    teams = {"research": Team("research", {"H100": 8}, borrow_limit=0)}
    ctx = ctx_of(teams=teams)
    stray = Entry(make_pjob("stray", "nobody").gpus(1).pending(), 0)
    assert not admit(ctx, stray) and stray.status is EntryStatus.INADMISSIBLE
    assert ctx.result.reasons["stray"] == "unknown team 'nobody'"
    big = Entry(make_pjob("big", "research").gpus(8).tasks(2).pending(), 1)
    assert not admit(ctx, big) and "borrowing limit of 0 GPUs" in big.reason
    small = Entry(make_pjob("small", "research").gpus(8).pending(), 2)
    assert admit(ctx, small) and small.team is teams["research"] and not small.borrowed
    cpu = Entry(make_pjob("cpu", "research").gpus(0).tasks(2).pending(), 3)
    assert admit(ctx, cpu)


def test_place_starts_best_fit_and_books_quota_and_remembers_a_shape_that_failed() -> None:
    six = make_pjob("six", "product").gpus(6).running([("n0", 6)])
    four = make_pjob("four", "product").gpus(4).running([("n1", 4)])
    ctx = ctx_of(running=[six, four])
    two = Entry(make_pjob("two", "research").gpus(2).pending(), 0)
    assert admit(ctx, two) and place(ctx, two)
    assert ctx.result.starts[0].slots == (("n0", 2),)  # best fit: the fuller node
    assert two.status is EntryStatus.STARTED
    assert ctx.quota.within_guarantee(TEAMS["research"], "H100", 6)
    assert not ctx.quota.within_guarantee(TEAMS["research"], "H100", 7)
    five = Entry(make_pjob("five", "research").gpus(5).pending(), 1)
    assert admit(ctx, five) and not place(ctx, five)
    assert ("H100", id(five.pending.job.placement), 1, 5) in ctx.no_fit


def test_backfill_uses_reserved_nodes_only_for_jobs_that_end_before_the_reservation() -> None:
    soon = make_pjob("soon", "product").gpus(4).limit(3600).running([("n0", 4)], start=0.0)
    later = make_pjob("later", "product").gpus(4).limit(7200).running([("n1", 4)], start=0.0)
    ctx = ctx_of(running=[soon, later], now=100.0)
    head = Entry(make_pjob("head", "research").gpus(8).pending(), 0)
    assert admit(ctx, head) and not place(ctx, head) and not preempt(ctx, head)
    reserve(ctx, head)
    reservation = ctx.result.reservation
    assert head.status is EntryStatus.RESERVED and reservation is not None
    assert reservation.nodes == ("n0",) and reservation.estimated_start == 3600.0  # ends first
    short = Entry(make_pjob("short", "research").gpus(4).limit(1000).pending(), 1)
    long = Entry(make_pjob("long", "research").gpus(4).limit(9000).pending(), 2)
    unknown = Entry(make_pjob("unknown", "research").gpus(4).pending(), 3)
    assert backfill(ctx, short) is not None
    assert backfill(ctx, long) is None and backfill(ctx, unknown) is None


def test_reserve_under_strict_fifo_blocks_the_line_behind_the_head() -> None:
    ctx = ctx_of(config=PolicyConfig.fifo())
    head = Entry(make_pjob("head", "research").gpus(8).tasks(3).pending(), 4)
    reserve(ctx, head)
    assert ctx.blocked_at == 4 and ctx.result.reservation is None
    assert head.status is EntryStatus.BLOCKED and "waiting for 24 H100 GPUs" in head.reason


def test_preempt_takes_a_higher_tier_victim_and_a_starving_job_one_with_more_service() -> None:
    now = 30 * HOUR
    # both running jobs are tier 3 (over 128 GPU-h); the victim pool skips jobs without GPUs
    first = make_pjob("first", "product").gpus(8).running([("n0", 8)], start=now - 20 * HOUR)
    second = make_pjob("second", "product").gpus(8).running([("n1", 8)], start=now - 25 * HOUR)
    running = [first, second, make_pjob("cpu", "product").gpus(0).running([("n0", 0)])]
    new = Entry(make_pjob("new", "research").gpus(8).submitted(now).pending(), 0)
    ctx = ctx_of(running=running, now=now)
    assert admit(ctx, new) and not place(ctx, new) and preempt(ctx, new)
    assert [p.job_id for p in ctx.result.preemptions] == ["first"]  # cheaper: less work since start
    assert "less attained service" in ctx.result.preemptions[0].reason
    assert new.status is EntryStatus.PREEMPTING and "n0" not in ctx.general.nodes
    # a tier-3 job (130 GPU-h) has no tier to yield to; starving (13 h back in the queue), it
    # may stop a job of its class with more attained service (first: 160 GPU-h); not starving,
    # or with more service than any victim, it may not (aging off, so the tier stays 3)
    no_aging = replace(PolicyConfig(), aging_s=1e9, starvation_s=12 * HOUR)
    for waited_h, attained_h, expected in ((13, 130, ["first"]), (5, 130, []), (13, 250, [])):
        heavy = make_pjob("heavy", "research").gpus(8).submitted(0.0)
        entry = Entry(heavy.pending(attained_h * HOUR, queued_since=now - waited_h * HOUR), 0)
        ctx = ctx_of(running=running, now=now, config=no_aging)
        assert admit(ctx, entry) and not place(ctx, entry)
        assert preempt(ctx, entry) is bool(expected)
        assert [p.job_id for p in ctx.result.preemptions] == expected
        if expected:
            assert "starving after 13 h in the queue" in ctx.result.preemptions[0].reason


def test_jobs_without_gpus_go_to_the_least_busy_nodes_one_task_each() -> None:
    run = make_pjob("r", "product").gpus(1).running([("n0", 1)])
    ctx = ctx_of(running=[run], nodes=make_cluster(nodes=3))
    two = Entry(make_pjob("two", "research").gpus(0).tasks(2).pending(), -1)
    assert place_without_gpus(ctx, two)
    assert ctx.result.starts[0].slots == (("n1", 0), ("n2", 0))
    four = Entry(make_pjob("four", "research").gpus(0).tasks(4).pending(), -1)
    assert not place_without_gpus(ctx, four)
    assert ctx.result.reasons["four"] == "waiting for 4 ready nodes; 3 ready"


def test_the_cycle_places_jobs_without_gpus_even_when_every_gpu_is_taken() -> None:
    full = make_pjob("full", "product").gpus(8).running([("n0", 8)])
    cpu = make_pjob("cpu", "research").gpus(0).pending()
    big = make_pjob("big", "research").gpus(8).pending()
    result = PolicyEngine().cycle(Snapshot(make_cluster(nodes=1), TEAMS, [big, cpu], [full]), 10.0)
    assert [s.job_id for s in result.starts] == ["cpu"] and result.order == ["big"]


def _starves(config: PolicyConfig, hours: int) -> float | None:
    """One 8-GPU node; team b (high decayed usage, so behind team s in fair share) waits with an
    8-GPU job while every 10 minutes one of team s's 2-GPU, 30-minute jobs ends and another
    arrives: 2 GPUs are always free, the small job passes, and the node never drains. Returns
    when the big job started (or was given its nodes by preemption), None if not in ``hours``."""
    engine = PolicyEngine(config)
    nodes = make_cluster(nodes=1)
    teams = make_teams("b", "s", guaranteed=8)
    big = make_pjob("big", "b").gpus(8).submitted(0.0).pending()
    running = [make_pjob(f"s{i}", "s").gpus(2).running([("n0", 2)], start=-600.0 * i) for i in range(3)]
    for step in range(1, hours * 6 + 1):
        now = 600.0 * step
        running = [a for a in running if now - a.start_time < 1800.0]
        small = make_pjob(f"s{step + 2}", "s").gpus(2).submitted(now).pending()
        result = engine.cycle(Snapshot(nodes, teams, [big, small], running, {"b": 1e9, "s": 0.0}), now)
        started = {s.job_id: s for s in result.starts}
        if "big" in started or any(p.for_job == "big" for p in result.preemptions):
            return now
        if small.job.id in started:
            running.append(
                make_pjob(small.job.id, "s").gpus(2).running(list(started[small.job.id].slots), start=now)
            )
    return None


def test_a_big_job_that_small_ones_keep_passing_starts_after_the_starvation_threshold() -> None:
    threshold = PolicyConfig.forge().starvation_s
    assert threshold == 24 * HOUR
    assert _starves(replace(PolicyConfig.forge(), starvation_s=None), 72) is None  # starves
    started = _starves(PolicyConfig.forge(), 72)
    assert started is not None and threshold <= started <= threshold + 600.0
