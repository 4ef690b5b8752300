"""The model registry (registration, promotion and rollback with events, the release gate) and the run
service (runs, comparisons)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from forge.eval.v1 import eval_pb2
from forge.events.v1 import events_pb2
from prometheus_client import REGISTRY

from forge_eval.gate import Verdict
from forge_eval.registry import Lineage, ModelRegistry, Promotion
from forge_eval.runs import RunService
from forge_eval.serving import LocalModelServer
from forge_eval.store.registry import ModelRow, StageEventRow
from forge_eval.store.runs import ExampleRow, RunRow, RunStatus
from forge_kit import errors
from forge_kit.db import Database

pytestmark = pytest.mark.asyncio
Outbox = Any
RunModel = Any


async def count(db: Database, table: type) -> int:
    async with db.session() as session:
        return int(await session.scalar(sa.select(sa.func.count()).select_from(table)) or 0)


async def register(registry: ModelRegistry, *versions: str, name: str = "tiny") -> None:
    for version in versions:
        await registry.register_model(name, version, f"file:///ckpt/{name}/{version}", {"job": "j-1"})


async def promote(registry: ModelRegistry, version: str, stage: str, **kwargs: Any) -> Promotion:
    values: dict[str, Any] = {"traffic_percent": 0, "reason": "", **kwargs}
    return await registry.promote_model("tiny", version, stage, **values)


async def promotions(outbox: Outbox) -> list[Any]:
    rows = [r for r in await outbox() if r.event_type == events_pb2.ModelPromoted.DESCRIPTOR.full_name]
    return [(r.key, events_pb2.ModelPromoted.FromString(r.payload)) for r in rows]


async def passing(run_model: RunModel, *versions: str) -> None:
    """Give each version a finished run that passes the gate (there is no production yet)."""
    for version in versions:
        await run_model(version, [1.0, 0.0, 1.0])


# --- registry -------------------------------------------------------------------------------------


async def test_register_numbers_versions_and_refuses_duplicates(registry: ModelRegistry) -> None:
    first = await registry.register_model("tiny", "", "file:///a", {})
    second = await registry.register_model("tiny", "", "file:///b", {"job": "j-2"})
    assert (first.row.version, second.row.version, second.row.labels) == ("1", "2", {"job": "j-2"})
    assert first.stage == second.stage == "candidate"
    with pytest.raises(errors.AlreadyExistsError):
        await registry.register_model("tiny", "2", "file:///c", {})
    models, total = await registry.list_models("tiny", "", 10, 0)
    assert total == 2 and [m.row.version for m in models] == ["2", "1"]
    events, _ = await registry.list_stage_events("tiny", "1", "", forced_only=False, page_size=10, offset=0)
    assert [(e.row.action, e.row.from_stage, e.row.stage) for e in events] == [("register", "", "candidate")]


async def test_lineage_is_stored_with_its_registered_parent(registry: ModelRegistry) -> None:
    await register(registry, "1")
    child = await registry.register_model(
        "tiny", "2", "file:///b", {}, Lineage("run-7", "recipe-abc", "data-def", ("tiny", "1"))
    )
    assert (child.row.training_run_id, child.row.recipe_hash, child.row.data_hash) == (
        "run-7",
        "recipe-abc",
        "data-def",
    )
    assert child.parent == ("tiny", "1")


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("", "1", "file:///a", {}), "ref.name"),
        (("bad name", "1", "file:///a", {}), "ref.name"),
        (("tiny", "1/2", "file:///a", {}), "ref.version"),
        (("tiny", "1", "  ", {}), "uri"),
        (("tiny", "1", "file:///a", {"": "x"}), "labels"),
        (("tiny", "1", "file:///a", {}, Lineage(parent=("tiny", "0"))), "lineage.parent"),
        (("tiny", "1", "file:///a", {}, Lineage(recipe_hash="x" * 129)), "lineage.recipe_hash"),
    ],
)
async def test_bad_registration_names_the_field_and_writes_nothing(
    registry: ModelRegistry, db: Database, args: tuple[Any, ...], field: str
) -> None:
    with pytest.raises(errors.ValidationError) as caught:
        await registry.register_model(*args)
    assert caught.value.field == field
    assert await count(db, ModelRow) == 0 and await count(db, StageEventRow) == 0


async def test_lifecycle_candidate_canary_production_archived_with_events(
    registry: ModelRegistry, run_model: RunModel, outbox: Outbox
) -> None:
    await register(registry, "1", "2")
    await passing(run_model, "1", "2")
    canary = await promote(registry, "1", "canary", traffic_percent=10, actor="ops")
    assert (canary.model.stage, canary.model.traffic_percent, canary.previous) == ("canary", 10, None)
    production = await promote(registry, "1", "production")
    assert production.model.stage == "production" and production.event.row.from_stage == "canary"
    assert (await registry.list_models("", "canary", 10, 0))[1] == 0  # it left canary

    await promote(registry, "2", "canary", traffic_percent=10)
    replaced = await promote(registry, "2", "production", reason="better")
    again = await promote(registry, "2", "production", reason="a retried call")  # changes nothing
    assert again.event.row.id == replaced.event.row.id and again.previous is None
    assert replaced.previous is not None and replaced.previous.version == "1"
    stages = {m.row.version: m.stage for m in (await registry.list_models("tiny", "", 10, 0))[0]}
    assert stages == {"1": "archived", "2": "production"}

    events = await promotions(outbox)
    assert [(e.stage, e.model.version, e.previous.version, e.traffic_percent) for _, e in events] == [
        ("canary", "1", "", 10),
        ("production", "1", "", 100),
        ("canary", "2", "", 10),
        ("production", "2", "1", 100),
    ]
    assert events[-1][1].reason == "better" and events[-1][0] == b"production"
    trail, total = await registry.list_stage_events(
        "tiny", "1", "", forced_only=False, page_size=10, offset=0
    )
    assert [(e.row.action, e.row.from_stage, e.row.stage) for e in reversed(trail)] == [
        ("register", "", "candidate"),
        ("promote", "candidate", "canary"),
        ("promote", "canary", "production"),
        ("archive", "production", "archived"),
    ]
    assert (
        total == 4
        and trail[-2].row.actor == "ops"
        and trail[0].row.reason == "replaced in production by tiny:2"
    )
    assert trail[1].row.gate_run_id and not trail[1].row.forced


@pytest.mark.parametrize(
    ("path", "target", "message"),
    [
        (["production"], "canary", "tiny:1 is production; it cannot move to canary"),
        (["production"], "archived", "is production; it cannot move to archived"),
        (
            ["archived"],
            "production",
            r"is archived; it cannot move to production \(from archived: only a rollback\)",
        ),
    ],
)
async def test_transitions_outside_the_lifecycle_are_refused(
    registry: ModelRegistry, run_model: RunModel, db: Database, path: list[str], target: str, message: str
) -> None:
    await register(registry, "1")
    await passing(run_model, "1")
    for stage in path:
        await promote(registry, "1", stage)
    events = await count(db, StageEventRow)
    with pytest.raises(errors.ConflictError, match=message):
        await promote(registry, "1", target)
    assert await count(db, StageEventRow) == events


async def test_rollback_restores_the_replaced_model_and_archives_the_bad_one(
    registry: ModelRegistry, run_model: RunModel, outbox: Outbox
) -> None:
    await register(registry, "1", "2")
    await passing(run_model, "1", "2")
    await promote(registry, "1", "production")
    await promote(registry, "2", "production")
    back = await registry.rollback_model("production", "bad release", actor="oncall")
    assert (back.model.row.version, back.model.stage, back.previous and back.previous.version) == (
        "1",
        "production",
        "2",
    )
    assert (back.event.row.action, back.event.row.from_stage, back.event.row.actor) == (
        "rollback",
        "archived",
        "oncall",
    )
    stages = {m.row.version: m.stage for m in (await registry.list_models("tiny", "", 10, 0))[0]}
    assert stages == {"1": "production", "2": "archived"}
    _, last = (await promotions(outbox))[-1]
    assert (last.model.version, last.previous.version, last.is_rollback, last.reason) == (
        "1",
        "2",
        True,
        "bad release",
    )
    with pytest.raises(errors.ConflictError, match="no earlier model"):
        await registry.rollback_model("production", "")


async def test_canary_rollback_skips_repeated_promotions_of_the_same_model(
    registry: ModelRegistry, run_model: RunModel
) -> None:
    await register(registry, "1", "2")
    await passing(run_model, "1", "2")
    await promote(registry, "1", "canary", traffic_percent=10)
    await promote(registry, "2", "canary", traffic_percent=10)
    await promote(registry, "2", "canary", traffic_percent=50)  # a new share, same model
    back = await registry.rollback_model("canary", "")
    assert (back.model.row.version, back.model.traffic_percent, back.previous and back.previous.version) == (
        "1",
        10,
        "2",
    )


async def test_rollback_of_an_empty_stage_is_refused(registry: ModelRegistry, db: Database) -> None:
    with pytest.raises(errors.ConflictError, match="no model"):
        await registry.rollback_model("production", "")
    with pytest.raises(errors.ValidationError) as caught:
        await registry.rollback_model("archived", "")
    assert caught.value.field == "stage" and await count(db, StageEventRow) == 0


@pytest.mark.parametrize(
    ("name", "version", "stage", "traffic", "field"),
    [
        ("tiny", "", "production", 0, "ref.version"),
        ("tiny", "1", "", 0, "stage"),
        ("tiny", "1", "Prod!", 0, "stage"),
        ("tiny", "1", "candidate", 0, "stage"),
        ("tiny", "1", "canary", 101, "traffic_percent"),
    ],
)
async def test_bad_promotion_names_the_field_and_writes_nothing(
    registry: ModelRegistry,
    db: Database,
    outbox: Outbox,
    name: str,
    version: str,
    stage: str,
    traffic: int,
    field: str,
) -> None:
    await register(registry, "1")
    with pytest.raises(errors.ValidationError) as caught:
        await registry.promote_model(name, version, stage, traffic_percent=traffic, reason="")
    assert caught.value.field == field
    assert await count(db, StageEventRow) == 1 and await outbox() == []  # the registration only


async def test_promoting_an_unknown_model_is_not_found(registry: ModelRegistry) -> None:
    with pytest.raises(errors.NotFoundError):
        await promote(registry, "9", "production")


# --- the release gate ----------------------------------------------------------------------------


async def test_gate_refuses_a_model_without_runs_and_writes_nothing(
    registry: ModelRegistry, outbox: Outbox, db: Database
) -> None:
    await register(registry, "1")
    for stage in ("canary", "production"):
        with pytest.raises(errors.ConflictError, match="tiny:1 has no eval runs; an admin may force it"):
            await promote(registry, "1", stage)
    assert await outbox() == [] and await count(db, StageEventRow) == 1
    archived = await promote(registry, "1", "archived")  # archiving needs no gate
    assert archived.model.stage == "archived" and await promotions(outbox) == []


async def test_gate_refuses_a_model_whose_runs_failed_and_says_why(
    registry: ModelRegistry, run_model: RunModel
) -> None:
    await register(registry, "1")
    run_id = await run_model("1", [])  # the runner scores nothing: the run fails
    with pytest.raises(errors.ConflictError) as caught:
        await promote(registry, "1", "production")
    assert run_id in caught.value.message and "FAILED: the runner scored no examples" in caught.value.message


async def test_gate_passes_without_a_baseline_and_blocks_a_regression(
    registry: ModelRegistry, runs: RunService, run_model: RunModel
) -> None:
    await register(registry, "1", "2", "3")

    def gate(decision: str) -> float:
        value = REGISTRY.get_sample_value("forge_eval_gate_total", {"suite": "gsm8k", "decision": decision})
        return value or 0.0

    blocked_before, passed_before = gate("blocked"), gate("passed")
    first = await run_model("1", [1.0] * 80 + [0.0] * 20)
    done = await promote(registry, "1", "production")
    assert done.model.stage == "production" and done.model.eval_run_ids == (first,)
    assert done.event.row.reason == f"gate passed: eval run {first}"

    worse = await run_model("2", [1.0] * 40 + [0.0] * 60)  # 40 examples broken, none fixed
    run, _ = await runs.get_run(worse)
    assert run.status == RunStatus.SUCCEEDED and not run.passed_gate
    with pytest.raises(errors.ConflictError, match="failed the gate"):
        await promote(registry, "2", "production")

    same = await run_model("3", [1.0] * 80 + [0.0] * 20)
    assert (await runs.get_run(same))[0].passed_gate
    done = await promote(registry, "3", "production")
    assert done.previous is not None and done.previous.version == "1"
    # The decisions are counted for the eval-gate alert (forge_eval_gate_total).
    assert (gate("passed") - passed_before, gate("blocked") - blocked_before) == (2, 1)


async def test_only_an_admin_may_force_past_the_gate_and_it_is_audited(
    registry: ModelRegistry, run_model: RunModel, db: Database
) -> None:
    await register(registry, "1", "2")
    await run_model("1", [1.0] * 80 + [0.0] * 20)
    await promote(registry, "1", "production")
    worse = await run_model("2", [1.0] * 40 + [0.0] * 60)
    events = await count(db, StageEventRow)

    with pytest.raises(errors.PermissionDeniedError, match="ci is not an admin"):
        await promote(registry, "2", "production", force=True, reason="hotfix", actor="ci", admin=False)
    with pytest.raises(errors.ValidationError) as caught:
        await promote(registry, "2", "production", force=True, reason=" ", actor="alice")
    assert caught.value.field == "reason"
    with pytest.raises(errors.ValidationError) as caught:
        await promote(registry, "2", "archived", force=True, reason="x", actor="alice")
    assert caught.value.field == "force" and await count(db, StageEventRow) == events

    forced = await promote(registry, "2", "production", force=True, reason="hotfix for INC-42", actor="alice")
    row = forced.event.row
    assert (row.forced, row.actor, row.reason, row.gate_run_id) == (True, "alice", "hotfix for INC-42", "")
    report = json.loads(row.gate_report)
    assert report["runs"][0]["run_id"] == worse and not report["runs"][0]["passed_gate"]
    assert report["comparison"]["verdict"] == "WORSE" and report["comparison"]["production"] == "tiny:1"
    assert report["comparison"]["deltas"]["accuracy"]["delta"] == pytest.approx(-0.4)

    audited, total = await registry.list_stage_events("", "", "", forced_only=True, page_size=10, offset=0)
    assert total == 1 and audited[0].model == ("tiny", "2") and audited[0].previous == ("tiny", "1")
    assert audited[0].row.created_at is not None


# --- runs ----------------------------------------------------------------------------------------


async def test_run_suite_pins_the_spec_and_queues_the_run(runs: RunService, runner: Any) -> None:
    run = await runs.run_suite(
        "gsm8k", "tiny", "1", endpoint="", limit=10, seed=3, options={"temperature": "0"}
    )
    again = await runs.run_suite(
        "gsm8k", "tiny", "1", endpoint="http://other:8000", limit=10, seed=3, options={}
    )
    other = await runs.run_suite("gsm8k", "tiny", "1", endpoint="", limit=11, seed=3, options={})
    assert run.status == RunStatus.PENDING and run.endpoint == "http://127.0.0.1:9/"
    assert run.spec_hash == again.spec_hash != other.spec_hash  # the endpoint is not part of the spec
    assert run.spec["datasets"]["gsm8k/test.jsonl"].startswith("3730d312f6e34405")  # type: ignore[index]
    assert run.spec["scorer_version"] == "gsm8k-scripted-1" and runner.calls == []


async def test_run_suite_refuses_a_seed_the_model_server_would_refuse(runs: RunService) -> None:
    """The run's seed becomes each request's sampling seed: past 2^63 - 1 it is refused here, not
    by every request of the run later."""
    for seed in (2**63, 2**64 - 1):
        with pytest.raises(errors.ValidationError) as caught:
            await runs.run_suite("gsm8k", "tiny", "1", endpoint="", limit=1, seed=seed, options={})
        assert caught.value.field == "seed"


async def test_run_suite_resolves_an_empty_version_to_the_latest_registered(
    registry: ModelRegistry, runs: RunService
) -> None:
    await register(registry, "1", "2")
    run = await runs.run_suite("bbh", "tiny", "", endpoint="", limit=1, seed=0, options={})
    assert run.model_version == "2"


@pytest.mark.parametrize(
    ("kwargs", "field", "words"),
    [
        ({"suite": "squad"}, "suite", "bbh, gsm8k, humaneval, mmlu"),
        ({"suite": "humaneval"}, "suite", "no scorer yet"),
        ({"name": ""}, "model.name", "empty"),
        ({"version": ""}, "model.version", "no registered version"),
        ({"endpoint": "ftp://x"}, "endpoint", "http"),
        ({"options": {"temperature": "hot"}}, "options.temperature", "number"),
    ],
)
async def test_bad_run_requests_name_the_field_and_write_nothing(
    runs: RunService, db: Database, kwargs: dict[str, Any], field: str, words: str
) -> None:
    args: dict[str, Any] = {
        "suite": "gsm8k",
        "name": "tiny",
        "version": "1",
        "endpoint": "",
        "limit": 0,
        "seed": 0,
        "options": {},
    }
    args.update(kwargs)
    with pytest.raises(errors.ValidationError) as caught:
        await runs.run_suite(args.pop("suite"), args.pop("name"), args.pop("version"), **args)
    assert caught.value.field == field and words in caught.value.message
    assert await count(db, RunRow) == 0


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A folder shaped like a Hugging Face checkpoint (what serve_model checks at request time)."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


@pytest.fixture
def serving_runs(db: Database, catalog: Any, runner: Any, tmp_path: Path) -> RunService:
    return RunService(
        db,
        catalog,
        runner,
        default_endpoint="http://127.0.0.1:9/",
        model_host=LocalModelServer(work_dir=tmp_path / "serving"),
        reports_dir=tmp_path / "reports",
    )


@pytest.mark.parametrize(
    ("kwargs", "uri", "field", "words"),
    [
        ({"tier": "tiny"}, "", "tier", "full, smoke"),
        ({"serve_model": True, "endpoint": "http://x"}, "", "endpoint", "must be empty with serve_model"),
        ({"serve_model": True}, "s3://bucket/ckpt", "serve_model", "is not a local checkpoint folder"),
        ({"serve_model": True, "version": "9"}, "", "model", "must be registered"),
    ],
)
async def test_bad_tier_and_serving_requests_name_the_field(
    serving_runs: RunService,
    registry: ModelRegistry,
    db: Database,
    checkpoint: Path,
    kwargs: dict[str, Any],
    uri: str,
    field: str,
    words: str,
) -> None:
    await registry.register_model("tiny", "1", uri or str(checkpoint), {})
    args: dict[str, Any] = {"version": "1", "endpoint": "", "limit": 0, "seed": 0, "options": {}, **kwargs}
    with pytest.raises(errors.ValidationError) as caught:
        await serving_runs.run_suite("gsm8k", "tiny", args.pop("version"), **args)
    assert caught.value.field == field and words in caught.value.message
    assert await count(db, RunRow) == 0


async def test_served_and_smoke_runs_are_queued_with_their_tier(
    serving_runs: RunService, registry: ModelRegistry, runs: RunService, checkpoint: Path
) -> None:
    await registry.register_model("tiny", "1", f"file://{checkpoint}", {})
    served = await serving_runs.run_suite(
        "gsm8k", "tiny", "1", endpoint="", limit=5, seed=0, options={}, tier="smoke", serve_model=True
    )
    assert (served.serve_model, served.endpoint, served.tier, served.spec["tier"]) == (
        True,
        "",
        "smoke",
        "smoke",
    )
    full = await runs.run_suite("gsm8k", "tiny", "1", endpoint="", limit=5, seed=0, options={})
    assert full.spec["tier"] == "full" and full.spec_hash != served.spec_hash
    with pytest.raises(errors.ValidationError) as caught:
        await runs.run_suite("gsm8k", "tiny", "1", endpoint="", limit=5, seed=0, options={}, serve_model=True)
    assert caught.value.field == "serve_model" and "not configured" in caught.value.message


async def test_finished_runs_and_comparisons_write_reports(
    serving_runs: RunService, runner: Any, tmp_path: Path
) -> None:
    async def run(version: str, scores: list[float], tier: str) -> str:
        runner.scores[version] = scores
        queued = await serving_runs.run_suite(
            "gsm8k", "tiny", version, endpoint="", limit=len(scores), seed=1, options={}, tier=tier
        )
        assert await serving_runs.claim_next_run() == queued.id
        return (await serving_runs.execute_run(queued.id)).id

    base = await run("1", [1.0] * 8 + [0.0] * 2, "smoke")
    cand = await run("2", [1.0] * 5 + [0.0] * 5, "smoke")
    got, _ = await serving_runs.get_run(base)
    report = Path(got.report_path)
    assert report == tmp_path / "reports" / base / "report.md"
    text = report.read_text()
    assert "tier: **smoke**" in text and "Smoke tier" in text and "| accuracy | 10 | 0.8000 |" in text
    comparison = await serving_runs.compare_runs(base, cand)
    compared = Path(comparison.report_path).read_text()
    assert "tiny:2 vs tiny:1" in compared and "| accuracy | 10 | 0.8000 | 0.5000 | -0.3000 |" in compared
    with pytest.raises(errors.ConflictError, match="tier: 'smoke' vs 'full'"):
        await serving_runs.compare_runs(base, await run("3", [1.0] * 10, "full"))


async def test_executed_run_stores_examples_metrics_and_event(
    runs: RunService, db: Database, run_model: RunModel, outbox: Outbox
) -> None:
    run_id = await run_model("1", [1.0, 0.0, 1.0, 1.0])
    run, metrics = await runs.get_run(run_id)
    assert (run.status, run.example_count, run.passed_gate) == (RunStatus.SUCCEEDED, 4, True)
    assert [(m.name, m.value, m.n) for m in metrics] == [("accuracy", 0.75, 4)]
    assert await count(db, ExampleRow) == 4
    (row,) = await outbox()
    event = events_pb2.EvalCompleted.FromString(row.payload)
    assert (event.run_id, event.suite, event.model.version, dict(event.metrics), event.spec_hash) == (
        run_id,
        "gsm8k",
        "1",
        {"accuracy": 0.75},
        run.spec_hash,
    )
    runs, total = await runs.list_runs("gsm8k", "tiny", 10, 0)
    assert total == 1 and runs[0][0].id == run_id and runs[0][1][0].name == "accuracy"


async def test_get_unknown_run_is_not_found(runs: RunService) -> None:
    with pytest.raises(errors.NotFoundError):
        await runs.get_run("run-missing")


# --- comparisons ---------------------------------------------------------------------------------


async def test_compare_runs_pairs_examples_and_gives_a_verdict(runs: RunService, run_model: RunModel) -> None:
    baseline = await run_model("1", [1.0] * 50 + [0.0] * 50)
    better = await run_model("2", [1.0] * 80 + [0.0] * 20)
    comparison = await runs.compare_runs(baseline, better)
    (delta,) = comparison.deltas
    assert (delta.name, delta.result.n, delta.result.delta) == ("accuracy", 100, pytest.approx(0.3))
    assert delta.result.p_value == pytest.approx(2 * 0.5**30) and delta.result.ci_low > 0
    assert comparison.verdict == Verdict.BETTER
    assert (await runs.compare_runs(better, baseline)).verdict == Verdict.WORSE
    assert (await runs.compare_runs(baseline, baseline)).verdict == Verdict.NO_DIFFERENCE


async def test_compare_refuses_different_specs_saying_what_differs(
    runs: RunService, run_model: RunModel
) -> None:
    a = await run_model("1", [1.0, 0.0])
    b = await run_model("2", [1.0, 0.0, 1.0])  # limit 3 instead of 2
    c = await run_model("3", [1.0, 0.0], suite="bbh")
    with pytest.raises(errors.ConflictError, match="limit: 2 vs 3"):
        await runs.compare_runs(a, b)
    with pytest.raises(
        errors.ConflictError, match=r"datasets: content hashes differ.*suite: 'gsm8k' vs 'bbh'"
    ):
        await runs.compare_runs(a, c)


async def test_compare_refuses_unfinished_runs(runs: RunService, run_model: RunModel) -> None:
    done = await run_model("1", [1.0])
    pending = await runs.run_suite("gsm8k", "tiny", "2", endpoint="", limit=1, seed=1, options={})
    with pytest.raises(errors.ConflictError, match="PENDING"):
        await runs.compare_runs(done, pending.id)
    with pytest.raises(errors.ValidationError) as caught:
        await runs.compare_runs(done, "")
    assert caught.value.field == "candidate_run_id"


async def test_domain_statuses_and_verdicts_keep_the_proto_numbers() -> None:
    """The API sends a run's status and a comparison's verdict as their numbers."""
    statuses = {n.removeprefix("RUN_STATUS_"): v for n, v in eval_pb2.RunStatus.items() if v}
    verdicts = {n.removeprefix("VERDICT_"): v for n, v in eval_pb2.Verdict.items() if v}
    assert {s.name: s.value for s in RunStatus} == statuses
    assert {v.name: v.value for v in Verdict} == verdicts
