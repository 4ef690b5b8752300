"""Policy engine: table-driven cases built with ``make_pjob(...)``; each asserts a decision a user
would notice (who starts, where, who is preempted, why a job waits)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from builders import make_cluster, make_pjob, make_teams

from forge_scheduler.policy import PolicyConfig, PolicyEngine, Snapshot, Team, UsageLedger, fragmentation
from forge_scheduler.policy.engine import never_fits
from forge_scheduler.policy.fragmentation import GpuShareCluster, NodeSpec, TaskShape, WorkloadMix
from forge_scheduler.policy.metrics import fair_shares, fairness, fragmented_gpus, jain_index
from forge_scheduler.policy.model import Allocation, Job, Node, PendingJob


@dataclass
class Case:
    name: str
    nodes: list[Node]
    teams: dict[str, Team]
    pending: list[PendingJob]
    running: list[Allocation] = field(default_factory=list)
    starts: dict[str, set[str]] = field(default_factory=dict)
    """job id → the set of nodes it must land on (empty set: anywhere)."""
    not_started: tuple[str, ...] = ()
    preempted: tuple[str, ...] = ()
    reason: dict[str, str] = field(default_factory=dict)
    """job id → substring of its pending reason."""
    now: float = 1000.0
    config: PolicyConfig = field(default_factory=PolicyConfig)


TWO_TEAMS = make_teams("research", "product", guaranteed=8)

CASES = [
    Case(
        "borrows the idle team's quota inside the cohort",
        make_cluster(nodes=2),
        TWO_TEAMS,
        [make_pjob("big", "research").gpus(8).tasks(2).pending()],
        starts={"big": {"n0", "n1"}},
    ),
    Case(
        "borrowing limit holds a job back",
        make_cluster(nodes=2),
        make_teams("research", "product", guaranteed=8, borrow_limit=4),
        [make_pjob("big", "research").gpus(8).tasks(2).pending()],
        not_started=("big",),
        reason={"big": "borrowing limit of 4 GPUs reached"},
    ),
    Case(
        "no spare in the cohort",
        make_cluster(nodes=2),
        {
            "research": Team("research", {"H100": 8}, cohort="a"),
            "product": Team("product", {"H100": 8}, cohort="b"),
        },
        [make_pjob("big", "research").gpus(8).tasks(2).pending()],
        not_started=("big",),
        reason={"big": "team quota exhausted and cohort has no spare"},
    ),
    Case(
        "reclaims borrowed quota for a team within its guarantee",
        make_cluster(nodes=2),
        TWO_TEAMS,
        [make_pjob("mine", "product").gpus(8).pending()],
        running=[
            make_pjob("own", "research").gpus(8).running([("n0", 8)]),
            make_pjob("lent", "research").gpus(8).running([("n1", 8)], borrowed=True),
        ],
        preempted=("lent",),
        reason={"mine": "preempting 1 job(s)"},
    ),
    Case(
        "gang is all or nothing: 8 on one node never split over two half-free nodes",
        make_cluster(nodes=2),
        TWO_TEAMS,
        [make_pjob("whole", "research").gpus(8).same_node().pending()],
        running=[
            make_pjob("a", "product").gpus(4).running([("n0", 4)]),
            make_pjob("b", "product").gpus(4).running([("n1", 4)]),
        ],
        not_started=("whole",),
        reason={"whole": "waiting for 8 H100 GPUs in one node; largest free block is 4"},
    ),
    Case(
        "a two-task gang may span nodes when placement allows it",
        make_cluster(nodes=2),
        TWO_TEAMS,
        [make_pjob("pair", "research").gpus(4).tasks(2).anywhere().pending()],
        running=[
            make_pjob("a", "product").gpus(4).running([("n0", 4)]),
            make_pjob("b", "product").gpus(4).running([("n1", 4)]),
        ],
        starts={"pair": {"n0", "n1"}},
    ),
    Case(
        "same node group: lands in the group that has room",
        make_cluster(nodes=4, groups=2),
        make_teams("research", "product", guaranteed=16),
        [make_pjob("grp", "research").gpus(8).tasks(2).same_node_group().pending()],
        running=[make_pjob("a", "product").gpus(8).running([("n0", 8)])],
        starts={"grp": {"n2", "n3"}},
    ),
    Case(
        "same node group: waits, with the largest free block in words",
        make_cluster(nodes=4, groups=2),
        make_teams("research", "product", guaranteed=16),
        [make_pjob("grp", "research").gpus(8).tasks(2).same_node_group().pending()],
        running=[
            make_pjob("a", "product").gpus(3).running([("n0", 3)]),
            make_pjob("b", "product").gpus(8).running([("n1", 8)]),
            make_pjob("c", "product").gpus(8).running([("n2", 8)]),
            make_pjob("d", "product").gpus(1).running([("n3", 1)]),
        ],
        not_started=("grp",),
        reason={"grp": "waiting for 16 H100 GPUs in one node group; largest free block is 7"},
    ),
    Case(
        "best fit: a small job goes to the fuller node and keeps a whole node free",
        make_cluster(nodes=2),
        TWO_TEAMS,
        [make_pjob("small", "research").gpus(2).pending()],
        running=[make_pjob("a", "product").gpus(5).running([("n1", 5)])],
        starts={"small": {"n1"}},
    ),
    Case(
        "higher priority preempts the cheapest victim (latest checkpoint)",
        make_cluster(nodes=1),
        make_teams("research", "product", guaranteed=4),
        [make_pjob("urgent", "product").gpus(4).priority("high").pending()],
        running=[
            make_pjob("old-ckpt", "research")
            .gpus(4)
            .priority("preemptible")
            .running([("n0", 4)], last_checkpoint=100),
            make_pjob("new-ckpt", "research")
            .gpus(4)
            .priority("preemptible")
            .running([("n0", 4)], last_checkpoint=990),
        ],
        preempted=("new-ckpt",),
    ),
    Case(
        "minimum runtime protects a fresh victim",
        make_cluster(nodes=1),
        make_teams("research", "product", guaranteed=8),
        [make_pjob("urgent", "product").gpus(8).priority("high").pending()],
        running=[
            make_pjob("fresh", "research")
            .gpus(8)
            .priority("preemptible")
            .min_runtime(600)
            .running([("n0", 8)], start=900),
        ],
        not_started=("urgent",),
        reason={"urgent": "largest free block is 0"},
    ),
    Case(
        "a lower service tier preempts a long-running job of the same class",
        make_cluster(nodes=1),
        TWO_TEAMS,
        [make_pjob("short", "product").gpus(8).pending()],
        running=[make_pjob("long", "research").gpus(8).running([("n0", 8)], attained_gpu_s=10**6)],
        preempted=("long",),
    ),
    Case(
        "production inference pool is never used by training",
        make_cluster(nodes=2, inference_pool=1),
        TWO_TEAMS,
        [
            make_pjob("train", "research").gpus(8).pending(),
            make_pjob("train2", "research").gpus(8).submitted(1).pending(),
            make_pjob("serve", "product").gpus(8).priority("production").submitted(2).pending(),
        ],
        starts={"serve": {"n1"}, "train": {"n0"}},
        not_started=("train2",),
    ),
    Case(
        "strict FIFO stops at the first job that does not fit",
        make_cluster(nodes=1),
        TWO_TEAMS,
        [
            make_pjob("head", "research").gpus(8).submitted(0).pending(),
            make_pjob("small", "research").gpus(1).submitted(1).pending(),
        ],
        running=[make_pjob("a", "product").gpus(4).running([("n0", 4)])],
        not_started=("head", "small"),
        reason={"small": "strict FIFO"},
        config=PolicyConfig.fifo(),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_policy_decision(case: Case) -> None:
    result = PolicyEngine(case.config).cycle(
        Snapshot(case.nodes, case.teams, case.pending, case.running), case.now
    )
    started = {s.job_id: {n for n, _ in s.slots} for s in result.starts}
    for job_id, where in case.starts.items():
        assert job_id in started, result.reasons.get(job_id)
        if where:
            assert started[job_id] == where
    for job_id in case.not_started:
        assert job_id not in started
    assert sorted(p.job_id for p in result.preemptions) == sorted(case.preempted)
    for job_id, text in case.reason.items():
        assert text in result.reasons[job_id]


def test_backfill_never_delays_the_reservation() -> None:
    # n0: 4 GPUs busy until t=100; n1: 6 busy until t=50. The 8-GPU head reserves n0 (most free).
    nodes = make_cluster(nodes=2)
    running = [
        make_pjob("r0", "product").gpus(4).limit(100).running([("n0", 4)], start=0),
        make_pjob("r1", "product").gpus(6).limit(50).running([("n1", 6)], start=0),
    ]
    pending = [
        make_pjob("head", "research").gpus(8).submitted(0).limit(1000).pending(),
        make_pjob("short", "research").gpus(4).submitted(1).limit(50).pending(),
        make_pjob("long", "research").gpus(4).submitted(2).limit(5000).pending(),
        make_pjob("tiny", "research").gpus(2).submitted(3).limit(5000).pending(),
    ]
    result = PolicyEngine(PolicyConfig.fifo_backfill()).cycle(
        Snapshot(nodes, make_teams("research", "product", guaranteed=8), pending, running), 10.0
    )
    started = {s.job_id: s.slots for s in result.starts}
    assert result.reservation is not None and result.reservation.nodes == ("n0",)
    assert result.reservation.estimated_start == 100
    assert started["short"] == (("n0", 4),)  # ends at 60, before the reservation starts
    assert "long" not in started  # would hold n0 past t=100
    assert started["tiny"] == (("n1", 2),)  # outside the reservation


def test_no_starvation_of_a_big_job_under_a_stream_of_small_ones() -> None:
    """One 8-GPU node; 1-GPU jobs arrive every step and each runs 3 steps. The 8-GPU job gets a
    reservation, small jobs stop landing there, and it starts once the running ones end."""
    engine = PolicyEngine(PolicyConfig(preemption=False))
    teams = make_teams("research", "product", guaranteed=8)
    nodes = make_cluster(nodes=1)
    running: dict[str, tuple[Allocation, float]] = {
        f"s{i}": (make_pjob(f"s{i}", "product").gpus(1).running([("n0", 1)], start=0), 3 + i % 3)
        for i in range(8)
    }
    pending = {"big": make_pjob("big", "research").gpus(8).submitted(0).pending()}
    started_at = None
    for step in range(1, 30):
        now = float(step)
        running = {k: v for k, v in running.items() if v[1] > now}
        pending[f"p{step}"] = make_pjob(f"p{step}", "product").gpus(1).submitted(now).pending()
        result = engine.cycle(
            Snapshot(nodes, teams, list(pending.values()), [a for a, _ in running.values()]), now
        )
        for s in result.starts:
            job = pending.pop(s.job_id).job
            running[s.job_id] = (Allocation(job, s.slots, now), now + 3)
            if s.job_id == "big":
                started_at = now
        if started_at is not None:
            break
    assert started_at is not None and started_at <= 6


def test_aging_lifts_a_long_waiting_heavy_job_above_fresh_ones() -> None:
    engine = PolicyEngine(PolicyConfig(aging_s=3600.0))
    heavy = make_pjob("heavy", "research").gpus(1).pending(attained_gpu_s=10**6, queued_since=0.0)
    fresh = make_pjob("fresh", "research").gpus(1).submitted(9000.0).pending()
    snap = Snapshot(make_cluster(nodes=1, gpus=1), make_teams("research"), [heavy, fresh], [])
    assert engine.cycle(snap, 9001.0).order[0] == "fresh"  # tier 3, aged 2 tiers: still behind
    assert engine.cycle(snap, 4 * 3600.0).order[0] == "heavy"  # aged 4 tiers: tier 0 and older


def test_fair_share_orders_the_team_with_less_recent_usage_first() -> None:
    snap = Snapshot(
        make_cluster(nodes=1, gpus=1),
        make_teams("research", "product"),
        [make_pjob("r", "research").submitted(0).pending(), make_pjob("p", "product").submitted(5).pending()],
        [],
        usage={"research": 5000.0, "product": 10.0},
    )
    result = PolicyEngine().cycle(snap, 10.0)
    assert result.order == ["p", "r"]
    assert [s.job_id for s in result.starts] == ["p"]


def test_same_input_gives_same_decisions_in_any_input_order() -> None:
    rng = random.Random(7)
    nodes = make_cluster(nodes=16, groups=4)
    teams = make_teams("a", "b", "c", guaranteed=40)
    jobs = [
        make_pjob(f"j{i}", rng.choice("abc"))
        .gpus(rng.choice([1, 2, 4, 8]))
        .tasks(rng.choice([1, 1, 2]))
        .priority(rng.choice(["normal", "high", "preemptible"]))
        .submitted(rng.random() * 100)
        .pending()
        for i in range(200)
    ]
    first = PolicyEngine().cycle(Snapshot(nodes, teams, jobs, []), 200.0)
    shuffled = list(jobs)
    rng.shuffle(shuffled)
    second = PolicyEngine().cycle(Snapshot(nodes, teams, shuffled, []), 200.0)
    assert first.starts == second.starts and first.reasons == second.reasons
    assert sum(s.slots[0][1] * len(s.slots) for s in first.starts) <= 16 * 8


@pytest.mark.parametrize("policy", ["fifo", "fifo-backfill", "multifactor"])
def test_baseline_orders_match_their_keys_with_ties_by_job_id(policy: str) -> None:
    """The baselines' orderings equal a plain sort on the documented keys, ties to the lower id,
    whatever order the snapshot lists the jobs in (many share a submit time, team and size)."""
    rng = random.Random(3)
    teams = make_teams("a", "b", "c", guaranteed=8)
    usage = {"a": 10.0, "b": 500.0, "c": 0.0}
    jobs = [
        make_pjob(f"j{rng.randrange(1000):03d}-{i}", rng.choice("abc"))
        .gpus(rng.choice([1, 8]))
        .priority(rng.choice(["normal", "high"]))
        .submitted(float(rng.choice([0, 100, 200])))
        .pending()
        for i in range(120)
    ]
    config = {
        "fifo": PolicyConfig.fifo(),
        "fifo-backfill": PolicyConfig.fifo_backfill(),
        "multifactor": PolicyConfig.multifactor(),
    }[policy]
    now = 3 * 86400.0
    if policy == "multifactor":
        w_age, w_fs, w_size = config.multifactor_weights
        fs = {t: 2.0 ** (-(usage[t] / 510.0) / (1 / 3)) for t in usage}

        def key(p: PendingJob) -> tuple[object, ...]:
            age = min(1.0, max(0.0, now - p.job.submit_time) / config.multifactor_max_age_s)
            score = w_age * age + w_fs * fs[p.job.team] + w_size * p.job.gpus / 8
            return (-int(p.job.priority), -score, p.job.submit_time, p.job.id)
    else:

        def key(p: PendingJob) -> tuple[object, ...]:
            return (p.job.submit_time, p.job.id)

    expected = [p.job.id for p in sorted(jobs, key=key)]
    for listing in (jobs, jobs[::-1], rng.sample(jobs, len(jobs))):
        snap = Snapshot(make_cluster(nodes=1, gpus=8), teams, listing, [], usage=usage)
        assert PolicyEngine(config).cycle(snap, now).order == expected


def test_production_inference_displaces_a_preemptible_flood_within_one_cycle_plus_grace() -> None:
    config = PolicyConfig(preemption_grace_s=30.0)
    engine = PolicyEngine(config)
    nodes = make_cluster(nodes=4)
    teams = make_teams("research", "product", guaranteed=16)
    flood = [
        make_pjob(f"f{i}", "research").gpus(1).priority("preemptible").running([(f"n{i // 8}", 1)], start=0)
        for i in range(32)
    ]
    serve = make_pjob("serve", "product").gpus(8).priority("production").submitted(100).pending()
    first = engine.cycle(Snapshot(nodes, teams, [serve], flood), 100.0)
    assert not first.starts and len(first.preemptions) == 8
    assert {p.stop_by for p in first.preemptions} == {130.0}
    stopped = {p.job_id for p in first.preemptions}
    second = engine.cycle(
        Snapshot(nodes, teams, [serve], [a for a in flood if a.job.id not in stopped]), 130.0
    )
    assert [s.job_id for s in second.starts] == ["serve"]


def test_production_inference_is_placed_within_one_cycle_plus_grace_under_a_queued_flood() -> None:
    """The cluster is full of 1-GPU preemptible jobs (half of them still inside their minimum
    runtime) and 2,000 more wait ahead of the production request: the first cycle orders only
    preemptions for it, and the first cycle after the grace period starts it on the freed nodes."""
    grace = 60.0
    engine = PolicyEngine(PolicyConfig(preemption_grace_s=grace))
    nodes = make_cluster(nodes=32, groups=4)
    teams = {**make_teams("research", guaranteed=128), **make_teams("product", guaranteed=64)}
    running = [
        make_pjob(f"run{i:03d}", "research")
        .gpus(1)
        .priority("preemptible")
        .min_runtime(10_000.0 if (i // 8) % 2 == 0 else 0.0)
        .running([(f"n{i // 8}", 1)], start=0.0, borrowed=i >= 128)
        for i in range(32 * 8)
    ]
    rng = random.Random(7)
    queued = [
        make_pjob(f"q{i:04d}", "research")
        .gpus(rng.choice([1, 2, 4, 8]))
        .priority("preemptible")
        .submitted(i * 0.1)
        .pending()
        for i in range(2000)
    ]
    serve = make_pjob("serve", "product").tasks(2).gpus(8).priority("production").submitted(1000).pending()
    now = 1000.0

    first = engine.cycle(Snapshot(nodes, teams, [*queued, serve], running), now)

    assert first.starts == []
    assert first.order[0] == "serve"
    assert len(first.preemptions) == 16 and {p.for_job for p in first.preemptions} == {"serve"}
    assert {p.stop_by for p in first.preemptions} == {now + grace}
    stopped = {p.job_id for p in first.preemptions}
    freed = {a.slots[0][0] for a in running if a.job.id in stopped}
    assert len(freed) == 2 and all(int(n[1:]) % 2 == 1 for n in freed), "only nodes past min runtime"
    assert "grace period" in first.reasons["serve"]

    left = [a for a in running if a.job.id not in stopped]
    second = engine.cycle(Snapshot(nodes, teams, [*queued, serve], left), now + grace)

    assert [s.job_id for s in second.starts] == ["serve"]
    assert {n for n, _ in second.starts[0].slots} == freed


def test_usage_ledger_halves_after_one_half_life() -> None:
    ledger = UsageLedger(half_life_s=100.0)
    ledger.advance(1.0, {"a": 10})
    held = ledger.snapshot()["a"]
    ledger.advance(101.0, {})
    assert ledger.snapshot()["a"] == pytest.approx(held / 2)
    with pytest.raises(ValueError, match="now"):
        ledger.advance(50.0, {})


def test_metrics_jain_fair_share_and_fragmentation() -> None:
    assert jain_index([1, 1, 1]) == pytest.approx(1.0)
    assert jain_index([3, 0, 0]) == pytest.approx(1 / 3)
    assert fair_shares(12, {"a": 2, "b": 100, "c": 100}, {}) == {"a": 2, "b": 5, "c": 5}
    jain, deviation = fairness(12, {"a": 2, "b": 10, "c": 0}, {"a": 2, "b": 100, "c": 100}, {})
    assert jain < 0.8 and deviation == pytest.approx(10 / 3)
    assert fragmented_gpus({"n0": 3, "n1": 8, "n2": 0}, [4, 8]) == 3
    assert fragmented_gpus({"n0": 3}, []) == 0


@pytest.mark.parametrize(
    ("job", "refusal"),
    [
        (make_pjob("ok").gpus(8).tasks(2).same_node_group().build(), None),
        (
            make_pjob("grp").gpus(8).tasks(3).same_node_group().build(),
            "asks 24 H100 GPUs in one node group; the largest there is 16",
        ),
        (make_pjob("node").gpus(16).build(), "asks 16 H100 GPUs in one node; the largest there is 8"),
        (make_pjob("type").gpus(1, "A100").build(), "asks 1 A100 GPUs in one node; the largest there is 0"),
    ],
)
def test_a_job_that_can_never_fit_is_refused_with_the_reason(job: Job, refusal: str | None) -> None:
    assert never_fits(job, make_cluster(nodes=4, groups=2)) == refusal


def test_backfill_into_a_reservation_never_overbooks_a_node_started_on_this_cycle() -> None:
    nodes = make_cluster(nodes=2)
    running = [make_pjob("r", "product").gpus(6).limit(100).running([("n1", 6)], start=0)]
    pending = [
        make_pjob("a", "research").gpus(3).submitted(0).limit(500).pending(),  # lands on n0
        make_pjob("big", "research").gpus(8).submitted(1).limit(500).pending(),  # reserves n0
        make_pjob("c", "research").gpus(5).submitted(2).limit(100).pending(),
        make_pjob("d", "research").gpus(3).submitted(3).limit(100).pending(),
    ]
    result = PolicyEngine(PolicyConfig.fifo_backfill()).cycle(
        Snapshot(nodes, make_teams("research", "product", guaranteed=16), pending, running), 10.0
    )
    booked: dict[str, int] = {"n1": 6}
    for start in result.starts:
        for name, gpus in start.slots:
            booked[name] = booked.get(name, 0) + gpus
    assert result.reservation is not None and result.reservation.nodes == ("n0",)
    assert result.reservation.estimated_start == 510.0  # a, started this cycle, ends then
    assert all(used <= 8 for used in booked.values()), booked


# ---------------------------------------------------------------------------- FGD packing
def _brute_force_fragmentation(cluster: GpuShareCluster, mix: WorkloadMix) -> list[float]:
    """FGD's definition, shape by shape and GPU by GPU (the reference for the closed form)."""
    out = []
    for n in range(len(cluster.nodes)):
        gpus = [int(g) for g in cluster.gpu[n] if g >= 0]
        lost = 0.0
        for shape, demand in mix.demand.items():
            fits = [g for g in gpus if g >= shape.gpu_milli]
            hosts = (
                cluster.cpu[n] >= shape.cpu_milli
                and cluster.mem[n] >= shape.memory_mib
                and (not shape.gpu_models or cluster.nodes[n].gpu_model in shape.gpu_models)
                and len(fits) >= shape.gpus
            )
            lost += demand * (sum(gpus) - (sum(fits) if hosts else 0))
        out.append(lost / mix.total)
    return out


def test_fragmentation_counts_gpus_a_task_could_not_use() -> None:
    cluster = GpuShareCluster([NodeSpec("n0", 8000, 65536, 2, "T4")])
    cluster.bind(0, TaskShape(0, 0, 1, 700), [1])  # GPUs now [1000, 300]
    mix = WorkloadMix()
    mix.observe(TaskShape(4000, 1024, 1, 500), times=2)  # fits GPU 0: the 300 on GPU 1 is lost to it
    mix.observe(TaskShape(16000, 1024, 1, 1000))  # too little CPU: all 1300 free milli are lost to it
    # weighed by demand: 1000 milli of each
    assert cluster.fragmentation(mix).tolist() == [pytest.approx((300 + 1300) / 2)]


@pytest.mark.parametrize("table", [True, False], ids=["count-table", "shape-by-shape"])
def test_fragmentation_closed_form_matches_the_definition(
    table: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not table:
        monkeypatch.setattr(fragmentation, "_TABLE_BUDGET", 0)
    rng = random.Random(3)
    specs = [
        NodeSpec(
            f"n{i}", rng.choice([16000, 64000]), rng.choice([65536, 262144]), g, rng.choice(["T4", "V100"])
        )
        for i, g in enumerate([1, 2, 4, 8, 8, 2])
    ]
    cluster = GpuShareCluster(specs)
    shapes = [
        TaskShape(rng.choice([2000, 8000, 24000]), rng.choice([4096, 32768]), k, m, models)
        for k, m, models in [
            (1, 250, ()),
            (1, 500, ("T4",)),
            (1, 1000, ()),
            (2, 1000, ()),
            (8, 1000, ("V100",)),
        ]
    ]
    mix = WorkloadMix()
    for _ in range(40):
        task = rng.choice(shapes)
        mix.observe(task)
        cand = cluster.candidates(task)
        if len(cand):
            node, gpus = cluster.place_fgd(task, mix, cand)
            cluster.bind(node, task, gpus)
        assert cluster.fragmentation(mix).tolist() == pytest.approx(_brute_force_fragmentation(cluster, mix))


def test_fgd_keeps_whole_gpus_whole_for_whole_gpu_tasks() -> None:
    cluster = GpuShareCluster([NodeSpec("one-gpu", 64000, 262144, 1), NodeSpec("used", 64000, 262144, 2)])
    cluster.bind(1, TaskShape(1000, 1024, 1, 400), [1])  # "used": GPUs [1000, 600]
    mix = WorkloadMix()
    mix.observe(TaskShape(1000, 1024, 1, 1000), times=3)
    half = TaskShape(1000, 1024, 1, 500)
    mix.observe(half)
    # best fit (least GPU left on the node) would cut the one-GPU node's whole GPU in half; FGD
    # puts the share on the partly used GPU, which whole-GPU tasks could not use anyway
    assert cluster.place_fgd(half, mix, cluster.candidates(half)) == (1, [1])


def test_fgd_leaves_cpu_with_the_gpus_that_need_it() -> None:
    # same free GPUs, so GPU best fit cannot tell the nodes apart; only one keeps CPU for its
    # second GPU after the task lands
    cluster = GpuShareCluster([NodeSpec("lean", 12000, 262144, 2), NodeSpec("rich", 96000, 262144, 2)])
    task = TaskShape(8000, 1024, 1, 1000)
    mix = WorkloadMix()
    mix.observe(task, times=5)
    assert cluster.place_fgd(task, mix, cluster.candidates(task))[0] == 1


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"gpus": 1, "gpu_milli": 0}, "gpu_milli"),
        ({"gpus": 2, "gpu_milli": 500}, "gpu_milli"),
        ({"gpus": -1}, "gpus"),
        ({"cpu_milli": -5}, "cpu_milli"),
    ],
)
def test_task_shape_refuses_bad_requests_naming_the_field(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        TaskShape(**kwargs)


def test_bind_refuses_to_overcommit_a_node() -> None:
    cluster = GpuShareCluster([NodeSpec("n0", 4000, 8192, 1)])
    with pytest.raises(ValueError, match="over-committed"):
        cluster.bind(0, TaskShape(8000, 1024, 1, 1000), [0])
