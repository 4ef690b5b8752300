"""A guarded canary's decisions in the registry: promote, rollback (the gateway told), extend,
pause and resume, each audited with its evidence; retries and bad input."""

from __future__ import annotations

import json
from typing import Any

import pytest
from forge.events.v1 import events_pb2

from forge_eval.registry import ModelRegistry
from forge_eval.rollout import decide_rollout
from forge_kit import errors

pytestmark = pytest.mark.asyncio
EVIDENCE = json.dumps({"policy": "default@1", "elapsed_s": 42.0, "metrics": {}})


async def canary(registry: ModelRegistry, run_model: Any) -> None:
    for version in ("1", "2"):
        await registry.register_model("tiny", version, f"file:///ckpt/{version}", {})
        await run_model(version, [1.0, 0.0, 1.0])
    await registry.promote_model("tiny", "1", "production", traffic_percent=0, reason="first")
    await registry.promote_model("tiny", "2", "canary", traffic_percent=10, reason="gate passed")


async def promoted_events(outbox: Any) -> list[events_pb2.ModelPromoted]:
    rows = [r for r in await outbox() if r.event_type == events_pb2.ModelPromoted.DESCRIPTOR.full_name]
    return [events_pb2.ModelPromoted.FromString(r.payload) for r in rows]


async def test_rollback_archives_the_canary_records_why_and_tells_the_gateway(
    registry: ModelRegistry, run_model: Any, outbox: Any
) -> None:
    await canary(registry, run_model)
    done = await decide_rollout(
        registry, "tiny", "2", "rollback", "errors 5.2% vs 0%", EVIDENCE, actor="service"
    )
    row = done.event.row
    assert (row.action, row.from_stage, row.stage, row.actor) == ("rollback", "canary", "archived", "service")
    assert "errors 5.2% vs 0%" in row.reason and json.loads(row.evidence)["policy"] == "default@1"
    assert done.model.stage == "archived"
    last = (await promoted_events(outbox))[-1]
    assert (last.stage, last.model.version, last.traffic_percent, last.is_rollback) == (
        "canary",
        "2",
        0,
        True,
    )
    assert not last.previous.name
    # A retried call (its answer lost) returns the same record and publishes nothing more.
    again = await decide_rollout(registry, "tiny", "2", "rollback", "retry", EVIDENCE)
    assert again.event.row.id == row.id and len(await promoted_events(outbox)) == 3
    production = (await registry.list_models("tiny", "production", 10, 0))[0]
    assert [m.row.version for m in production] == ["1"]


async def test_promote_moves_canary_to_production_and_keeps_the_old_one_for_rollback(
    registry: ModelRegistry, run_model: Any
) -> None:
    await canary(registry, run_model)
    done = await decide_rollout(
        registry, "tiny", "2", "promote", "no worse on errors", EVIDENCE, actor="service"
    )
    assert (done.model.stage, done.event.row.from_stage, done.event.row.evidence) == (
        "production",
        "canary",
        EVIDENCE,
    )
    assert done.previous is not None and done.previous.version == "1"
    back = await registry.rollback_model("production", "fast rollback", actor="oncall")
    assert back.model.row.version == "1"


async def test_extend_pause_resume_are_audit_rows_and_need_a_canary(
    registry: ModelRegistry, run_model: Any
) -> None:
    await canary(registry, run_model)
    for decision in ("extend", "pause", "resume"):
        done = await decide_rollout(registry, "tiny", "2", decision, f"{decision} it", actor="alice")
        assert (done.event.row.action, done.event.row.stage, done.event.row.traffic_percent) == (
            decision,
            "canary",
            10,
        )
    events, _ = await registry.list_stage_events("tiny", "2", "", forced_only=False, page_size=10, offset=0)
    assert [e.row.action for e in events][:3] == ["resume", "pause", "extend"]
    with pytest.raises(errors.ConflictError, match="not canary"):
        await decide_rollout(registry, "tiny", "1", "pause", "production is no canary")


@pytest.mark.parametrize(
    ("decision", "reason", "evidence", "field"),
    [
        ("ship-it", "why", "", "decision"),
        ("pause", "  ", "", "reason"),
        ("pause", "why", "[1, 2]", "evidence"),
        ("pause", "why", "{not json", "evidence"),
        ("pause", "why", json.dumps({"x": "y" * 70_000}), "evidence"),
        ("pause", "x" * 5000, "", "reason"),
    ],
)
async def test_bad_decisions_name_the_field_and_change_nothing(
    registry: ModelRegistry, run_model: Any, decision: str, reason: str, evidence: str, field: str
) -> None:
    await canary(registry, run_model)
    with pytest.raises(errors.ValidationError) as caught:
        await decide_rollout(registry, "tiny", "2", decision, reason, evidence)
    assert caught.value.field == field
    events, _ = await registry.list_stage_events("tiny", "2", "", forced_only=False, page_size=10, offset=0)
    assert events[0].row.action == "promote"
