"""The reward-model registry: immutable versions, what they were trained on, status changes."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa

from forge_kit import errors
from forge_kit.db import Database
from forge_preference_feedback.registry import HeldoutAccuracy, RewardModelRegistry
from forge_preference_feedback.store import RewardModelRow

if TYPE_CHECKING:
    from conftest import Clock

pytestmark = pytest.mark.asyncio
#: Held-out figures of a registered reward model (the Wilson interval of 310 wins in 500 pairs).
HELDOUT = HeldoutAccuracy(accuracy=0.62, ci95_low=0.5767, ci95_high=0.6614, n=500, interval="wilson")


def version(**overrides: Any) -> dict[str, Any]:
    """Keyword arguments of a valid registration, with ``overrides``."""
    fields: dict[str, Any] = {
        "uri": "file:///rm/1",
        "snapshot_id": "snap-3f2a9c",
        "backbone": "forge-policy-tiny:3",
        "heldout": HELDOUT,
        "metrics": {"val_loss": 0.64},
        "registered_by": "orchestrator",
    }
    return fields | overrides


async def test_versions_keep_what_they_were_trained_on(registry: RewardModelRegistry, clock: Clock) -> None:
    first = await registry.register("rm-small", "", **version())
    clock.advance(60)
    second = await registry.register("rm-small", "", **version(uri="file:///rm/2", snapshot_id="snap-77"))
    assert (first.version, second.version) == ("1", "2")
    got = await registry.get("rm-small", "1")
    assert (got.snapshot_id, got.backbone, got.uri, got.status, got.registered_by) == (
        "snap-3f2a9c",
        "forge-policy-tiny:3",
        "file:///rm/1",
        "candidate",
        "orchestrator",
    )
    assert (got.heldout_accuracy, got.heldout_ci95_low, got.heldout_ci95_high, got.heldout_n) == (
        0.62,
        pytest.approx(0.5767),
        pytest.approx(0.6614),
        500,
    )
    assert got.heldout_interval == "wilson" and got.metrics == {"val_loss": 0.64}
    assert (await registry.get("rm-small", "latest")).version == "2"
    assert (await registry.get("", "latest")).snapshot_id == "snap-77"
    rows, total = await registry.list("rm-small", 10, 0)
    assert total == 2 and [r.version for r in rows] == ["2", "1"]


async def test_a_version_is_never_registered_twice(registry: RewardModelRegistry, db: Database) -> None:
    await registry.register("rm", "7", **version())
    with pytest.raises(errors.AlreadyExistsError, match="immutable"):
        await registry.register("rm", "7", **version(uri="file:///elsewhere", snapshot_id="other"))
    assert (await registry.get("rm", "7")).uri == "file:///rm/1"


async def test_activating_retires_the_previous_active_and_records_who(
    registry: RewardModelRegistry, clock: Clock
) -> None:
    await registry.register("rm", "", **version())
    await registry.register("rm", "", **version())
    await registry.register("other", "", **version())
    with pytest.raises(errors.NotFoundError):
        await registry.get("rm", "active")
    await registry.set_status("rm", "1", "active", changed_by="boss")
    await registry.set_status("other", "1", "active", changed_by="boss")
    clock.advance(30)
    changed = await registry.set_status("rm", "2", "active", changed_by="alice-admin")
    assert (changed.status, changed.status_changed_by, changed.status_changed_at) == (
        "active",
        "alice-admin",
        clock.now,
    )
    first = await registry.get("rm", "1")
    assert (first.status, first.status_changed_by) == ("retired", "alice-admin")
    assert (await registry.get("rm", "active")).version == "2"
    assert (await registry.get("other", "active")).status == "active"  # another name is untouched
    with pytest.raises(errors.ValidationError) as caught:
        await registry.set_status("rm", "2", "deleted", changed_by="boss")
    assert caught.value.field == "status"
    with pytest.raises(errors.NotFoundError):
        await registry.set_status("rm", "9", "retired", changed_by="boss")


@pytest.mark.parametrize(
    ("name", "ver", "overrides", "field"),
    [
        ("", "1", {}, "ref.name"),
        ("rm", "v/1", {}, "ref.version"),
        ("rm", "latest", {}, "ref.version"),
        ("rm", "1", {"uri": " "}, "uri"),
        ("rm", "1", {"snapshot_id": ""}, "snapshot_id"),
        ("rm", "1", {"snapshot_id": "a b"}, "snapshot_id"),
        ("rm", "1", {"backbone": ""}, "backbone"),
        ("rm", "1", {"heldout": dataclasses.replace(HELDOUT, accuracy=1.2)}, "heldout.accuracy"),
        ("rm", "1", {"heldout": dataclasses.replace(HELDOUT, ci95_low=0.63)}, "heldout.ci95_low"),
        ("rm", "1", {"heldout": dataclasses.replace(HELDOUT, ci95_high=float("nan"))}, "heldout.ci95_high"),
        ("rm", "1", {"heldout": dataclasses.replace(HELDOUT, n=0)}, "heldout.n"),
        ("rm", "1", {"heldout": dataclasses.replace(HELDOUT, interval="normal")}, "heldout.interval"),
        ("rm", "1", {"metrics": {"acc": float("inf")}}, "metrics.acc"),
    ],
)
async def test_bad_registrations_name_the_field_and_write_nothing(
    registry: RewardModelRegistry, db: Database, name: str, ver: str, overrides: dict[str, Any], field: str
) -> None:
    with pytest.raises(errors.ValidationError) as caught:
        await registry.register(name, ver, **version(**overrides))
    assert caught.value.field == field
    async with db.session() as session:
        assert await session.scalar(sa.select(sa.func.count()).select_from(RewardModelRow)) == 0


async def test_get_needs_a_name_unless_it_asks_for_latest_or_active(registry: RewardModelRegistry) -> None:
    with pytest.raises(errors.ValidationError) as caught:
        await registry.get("", "3")
    assert caught.value.field == "ref.name"
    with pytest.raises(errors.NotFoundError, match="any name:latest"):
        await registry.get("", "latest")
