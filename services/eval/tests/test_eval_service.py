"""EvalService: registry, promotion and rollback with events, the release gate, runs, comparisons."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from forge.eval.v1 import eval_pb2
from forge.events.v1 import events_pb2

from forge_eval.service import EvalService
from forge_eval.store import ExampleRow, ModelRow, RunRow, StageEventRow
from forge_kit import errors
from forge_kit.db import Database

pytestmark = pytest.mark.asyncio
Outbox = Any
RunModel = Any


async def count(db: Database, table: type) -> int:
    async with db.session() as session:
        return int(await session.scalar(sa.select(sa.func.count()).select_from(table)) or 0)


async def register(service: EvalService, *versions: str, name: str = "tiny") -> None:
    for version in versions:
        await service.register_model(name, version, f"file:///ckpt/{name}/{version}", {"job": "j-1"})


# --- registry -------------------------------------------------------------------------------------


async def test_register_numbers_versions_and_refuses_duplicates(service: EvalService) -> None:
    first = await service.register_model("tiny", "", "file:///a", {})
    second = await service.register_model("tiny", "", "file:///b", {"job": "j-2"})
    assert (first.row.version, second.row.version, second.row.labels) == ("1", "2", {"job": "j-2"})
    with pytest.raises(errors.AlreadyExistsError):
        await service.register_model("tiny", "2", "file:///c", {})
    models, total = await service.list_models("tiny", "", 10, 0)
    assert total == 2 and [m.row.version for m in models] == ["2", "1"]


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("", "1", "file:///a", {}), "ref.name"),
        (("bad name", "1", "file:///a", {}), "ref.name"),
        (("tiny", "1/2", "file:///a", {}), "ref.version"),
        (("tiny", "1", "  ", {}), "uri"),
        (("tiny", "1", "file:///a", {"": "x"}), "labels"),
    ],
)
async def test_bad_registration_names_the_field_and_writes_nothing(
    service: EvalService, db: Database, args: tuple[Any, ...], field: str
) -> None:
    with pytest.raises(errors.ValidationError) as caught:
        await service.register_model(*args)
    assert caught.value.field == field
    assert await count(db, ModelRow) == 0


async def test_promote_then_rollback_restores_the_previous_holder_with_events(
    service: EvalService, outbox: Outbox
) -> None:
    await register(service, "1", "2")
    view, previous = await service.promote_model(
        "tiny", "1", "production", require_gate=False, traffic_percent=0, reason=""
    )
    assert (view.stage, view.traffic_percent, previous) == ("production", 100, None)
    view, previous = await service.promote_model(
        "tiny", "2", "production", require_gate=False, traffic_percent=0, reason="better"
    )
    assert previous is not None and previous.version == "1"
    holders, _ = await service.list_models("", "production", 10, 0)
    assert [m.row.version for m in holders] == ["2"]

    restored, removed = await service.rollback_model("production", "bad release")
    assert (restored.row.version, restored.stage, removed.version) == ("1", "production", "2")
    holders, _ = await service.list_models("", "production", 10, 0)
    assert [m.row.version for m in holders] == ["1"]

    events = [events_pb2.ModelPromoted.FromString(row.payload) for row in await outbox()]
    assert [(e.model.version, e.previous.version, e.is_rollback, e.reason) for e in events] == [
        ("1", "", False, "promoted"),
        ("2", "1", False, "better"),
        ("1", "2", True, "bad release"),
    ]
    assert all(e.stage == "production" and e.meta.producer == "eval" for e in events)
    assert [row.key for row in await outbox()] == [b"production"] * 3

    with pytest.raises(errors.ConflictError, match="no earlier model"):
        await service.rollback_model("production", "")


async def test_rollback_skips_repeated_promotions_of_the_same_model(service: EvalService) -> None:
    await register(service, "1", "2")
    for version in ("1", "2", "2"):
        await service.promote_model(
            "tiny", version, "canary", require_gate=False, traffic_percent=10, reason=""
        )
    restored, removed = await service.rollback_model("canary", "")
    assert (restored.row.version, restored.traffic_percent, removed.version) == ("1", 10, "2")


async def test_rollback_of_an_empty_stage_is_refused(service: EvalService, db: Database) -> None:
    with pytest.raises(errors.ConflictError, match="no model"):
        await service.rollback_model("production", "")
    assert await count(db, StageEventRow) == 0


@pytest.mark.parametrize(
    ("name", "version", "stage", "traffic", "field"),
    [
        ("tiny", "", "production", 0, "ref.version"),
        ("tiny", "1", "", 0, "stage"),
        ("tiny", "1", "Prod!", 0, "stage"),
        ("tiny", "1", "canary", 101, "traffic_percent"),
    ],
)
async def test_bad_promotion_names_the_field_and_writes_nothing(
    service: EvalService,
    db: Database,
    outbox: Outbox,
    name: str,
    version: str,
    stage: str,
    traffic: int,
    field: str,
) -> None:
    await register(service, "1")
    with pytest.raises(errors.ValidationError) as caught:
        await service.promote_model(
            name, version, stage, require_gate=False, traffic_percent=traffic, reason=""
        )
    assert caught.value.field == field
    assert await count(db, StageEventRow) == 0 and await outbox() == []


async def test_promoting_an_unknown_model_is_not_found(service: EvalService) -> None:
    with pytest.raises(errors.NotFoundError):
        await service.promote_model(
            "tiny", "9", "production", require_gate=False, traffic_percent=0, reason=""
        )


# --- the release gate ----------------------------------------------------------------------------


async def test_gate_refuses_a_model_without_runs_and_writes_nothing(
    service: EvalService, outbox: Outbox
) -> None:
    await register(service, "1")
    with pytest.raises(errors.ConflictError, match="tiny:1 has no eval runs"):
        await service.promote_model(
            "tiny", "1", "production", require_gate=True, traffic_percent=0, reason=""
        )
    assert await outbox() == []


async def test_gate_refuses_a_model_whose_runs_failed_and_says_why(
    service: EvalService, run_model: RunModel
) -> None:
    await register(service, "1")
    run_id = await run_model("1", [])  # the runner scores nothing: the run fails
    with pytest.raises(errors.ConflictError) as caught:
        await service.promote_model(
            "tiny", "1", "production", require_gate=True, traffic_percent=0, reason=""
        )
    assert run_id in caught.value.message and "FAILED: the runner scored no examples" in caught.value.message


async def test_gate_passes_without_a_baseline_and_blocks_a_regression(
    service: EvalService, run_model: RunModel
) -> None:
    await register(service, "1", "2", "3")
    first = await run_model("1", [1.0] * 80 + [0.0] * 20)
    view, _ = await service.promote_model(
        "tiny", "1", "production", require_gate=True, traffic_percent=0, reason=""
    )
    assert view.stage == "production" and view.eval_run_ids == (first,)

    worse = await run_model("2", [1.0] * 40 + [0.0] * 60)  # 40 examples broken, none fixed
    run, _ = await service.get_run(worse)
    assert run.status == eval_pb2.RUN_STATUS_SUCCEEDED and not run.passed_gate
    with pytest.raises(errors.ConflictError, match="failed the gate"):
        await service.promote_model(
            "tiny", "2", "production", require_gate=True, traffic_percent=0, reason=""
        )

    same = await run_model("3", [1.0] * 80 + [0.0] * 20)
    assert (await service.get_run(same))[0].passed_gate
    view, previous = await service.promote_model(
        "tiny", "3", "production", require_gate=True, traffic_percent=0, reason=""
    )
    assert previous is not None and previous.version == "1"


# --- runs ----------------------------------------------------------------------------------------


async def test_run_suite_pins_the_spec_and_queues_the_run(service: EvalService, runner: Any) -> None:
    run = await service.run_suite(
        "gsm8k", "tiny", "1", endpoint="", limit=10, seed=3, options={"temperature": "0"}
    )
    again = await service.run_suite(
        "gsm8k", "tiny", "1", endpoint="http://other:8000", limit=10, seed=3, options={}
    )
    other = await service.run_suite("gsm8k", "tiny", "1", endpoint="", limit=11, seed=3, options={})
    assert run.status == eval_pb2.RUN_STATUS_PENDING and run.endpoint == "http://127.0.0.1:9/"
    assert run.spec_hash == again.spec_hash != other.spec_hash  # the endpoint is not part of the spec
    assert run.spec["datasets"]["gsm8k/test.jsonl"].startswith("3730d312f6e34405")  # type: ignore[index]
    assert run.spec["scorer_version"] == "gsm8k-scripted-1" and runner.calls == []


async def test_run_suite_resolves_an_empty_version_to_the_latest_registered(service: EvalService) -> None:
    await register(service, "1", "2")
    run = await service.run_suite("bbh", "tiny", "", endpoint="", limit=1, seed=0, options={})
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
    service: EvalService, db: Database, kwargs: dict[str, Any], field: str, words: str
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
        await service.run_suite(args.pop("suite"), args.pop("name"), args.pop("version"), **args)
    assert caught.value.field == field and words in caught.value.message
    assert await count(db, RunRow) == 0


async def test_executed_run_stores_examples_metrics_and_event(
    service: EvalService, db: Database, run_model: RunModel, outbox: Outbox
) -> None:
    run_id = await run_model("1", [1.0, 0.0, 1.0, 1.0])
    run, metrics = await service.get_run(run_id)
    assert (run.status, run.example_count, run.passed_gate) == (eval_pb2.RUN_STATUS_SUCCEEDED, 4, True)
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
    runs, total = await service.list_runs("gsm8k", "tiny", 10, 0)
    assert total == 1 and runs[0][0].id == run_id and runs[0][1][0].name == "accuracy"


async def test_worker_recovers_runs_left_running(service: EvalService, runner: Any) -> None:
    runner.scores["1"] = [1.0]
    run = await service.run_suite("gsm8k", "tiny", "1", endpoint="", limit=1, seed=0, options={})
    assert await service.claim_next_run() == run.id
    assert await service.claim_next_run() is None  # claimed runs are not handed out twice
    import asyncio

    worker = asyncio.create_task(service.run_worker())  # a new process: the RUNNING run is re-queued
    for _ in range(200):
        if (await service.get_run(run.id))[0].status == eval_pb2.RUN_STATUS_SUCCEEDED:
            break
        await asyncio.sleep(0.01)
    worker.cancel()
    await asyncio.gather(worker, return_exceptions=True)
    assert (await service.get_run(run.id))[0].status == eval_pb2.RUN_STATUS_SUCCEEDED


async def test_get_unknown_run_is_not_found(service: EvalService) -> None:
    with pytest.raises(errors.NotFoundError):
        await service.get_run("run-missing")


# --- comparisons ---------------------------------------------------------------------------------


async def test_compare_runs_pairs_examples_and_gives_a_verdict(
    service: EvalService, run_model: RunModel
) -> None:
    baseline = await run_model("1", [1.0] * 50 + [0.0] * 50)
    better = await run_model("2", [1.0] * 80 + [0.0] * 20)
    comparison = await service.compare_runs(baseline, better)
    (delta,) = comparison.deltas
    assert (delta.name, delta.result.n, delta.result.delta) == ("accuracy", 100, pytest.approx(0.3))
    assert delta.result.p_value == pytest.approx(2 * 0.5**30) and delta.result.ci_low > 0
    assert comparison.verdict == eval_pb2.VERDICT_BETTER
    assert (await service.compare_runs(better, baseline)).verdict == eval_pb2.VERDICT_WORSE
    assert (await service.compare_runs(baseline, baseline)).verdict == eval_pb2.VERDICT_NO_DIFFERENCE


async def test_compare_refuses_different_specs_saying_what_differs(
    service: EvalService, run_model: RunModel
) -> None:
    a = await run_model("1", [1.0, 0.0])
    b = await run_model("2", [1.0, 0.0, 1.0])  # limit 3 instead of 2
    c = await run_model("3", [1.0, 0.0], suite="bbh")
    with pytest.raises(errors.ConflictError, match="limit: 2 vs 3"):
        await service.compare_runs(a, b)
    with pytest.raises(
        errors.ConflictError, match=r"datasets: content hashes differ.*suite: 'gsm8k' vs 'bbh'"
    ):
        await service.compare_runs(a, c)


async def test_compare_refuses_unfinished_runs(service: EvalService, run_model: RunModel) -> None:
    done = await run_model("1", [1.0])
    pending = await service.run_suite("gsm8k", "tiny", "2", endpoint="", limit=1, seed=1, options={})
    with pytest.raises(errors.ConflictError, match="PENDING"):
        await service.compare_runs(done, pending.id)
    with pytest.raises(errors.ValidationError) as caught:
        await service.compare_runs(done, "")
    assert caught.value.field == "candidate_run_id"
