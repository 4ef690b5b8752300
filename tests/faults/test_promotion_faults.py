"""Releases through the guarded canary with the orchestrator's clock ten minutes ahead, and with
the broker partitioned from the registry and the gateway meanwhile (``promotion_rig.py``).

A client runs ``eval_and_promote`` for one candidate after another (each passes the eval gate,
goes to canary, and is judged by the guarded canary's sequential analysis on the traffic the test
feeds): an identical canary (promoted), one that errs (rolled back), one with no traffic (extended
once, then rolled back). The registry's ``ModelPromoted`` events reach the gateway through the
broker, which moves the ``production``, ``forge-chat`` and ``canary`` aliases.

``canary_clock_ahead`` (the orchestrator +600 s, libfaketime): the canary windows stay right —
no candidate left canary sooner (the registry's unskewed stage events) than the workflow's
``decided_after_s`` says it was judged on, an identical canary is promoted before the window ends,
and the quiet canary is rolled back no sooner than window + extension and not minutes later.

``promotions_broker_partition``: the same releases while the broker is unreachable (both ways)
from the registry and the gateway for 15 s; the registry's outbox holds the events.

After each, the history check: every alias the gateway holds names a version the registry
promoted to that stage (``check_aliases``: never an alias on a model the registry did not
promote), the gateway's aliases and canary split converge on the registry's holders, and every
release ended with one decision.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from faultkit.history import Anomaly, History, check_aliases, verdict
from faultkit.host import faketime_library
from faultkit.scenario import Targets, clock_env, load_scenario, run_timeline
from forge.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from google.protobuf import json_format, struct_pb2
from promotion_rig import (
    EXTENSION_S,
    MODEL,
    ORCHESTRATOR_TOKEN,
    WINDOW_S,
    PromotionRig,
    Traffic,
    start_rig,
    stop_rig,
)

from forge_kit.grpckit import make_channel
from forge_kit.testing.requires import missing

pytestmark = [pytest.mark.integration, pytest.mark.faults_long, pytest.mark.timeout(600)]
#: (version, canary error rate, traffic on): the releases of each scenario, in order.
RELEASES = (("same", 0.0, True), ("errs", 0.3, True), ("quiet", 0.0, False))
SLACK_S = 30.0  # a loaded 2-core machine stretches every look; a skewed clock would be off by 600 s


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[PromotionRig]:
    if faketime_library() is None:
        missing("libfaketime is not installed (apt-get install faketime; `make test` does as root)")
    skew = clock_env(load_scenario("canary_clock_ahead"), "orchestrator")
    started = await start_rig(tmp_path, skew)
    feeder = asyncio.create_task(started.metrics.run())
    try:
        yield started
    finally:
        feeder.cancel()
        await asyncio.gather(feeder, return_exceptions=True)
        await stop_rig(started)


async def release(
    rig: PromotionRig, history: History, version: str, error: float, traffic: bool
) -> dict[str, Any]:
    """One eval-and-promote of ``tiny:version`` through the orchestrator; its canary traffic
    flows once the registry has it in canary (as a gateway would send it)."""
    production = (await rig.holders()).get("production", "")
    rig.metrics.traffic = Traffic(
        canary=f"{MODEL}:{version}", production=f"{MODEL}:{production}", canary_error=error
    )
    data = struct_pb2.Struct()
    data.update(
        {
            "model_name": MODEL,
            "model_version": version,
            "uri": f"file:///models/{MODEL}-{version}",
            "suite": "gsm8k",
            "limit": 6,
            "endpoint": rig.endpoint_url,
            "poll_s": 0.2,
            "run_timeout_s": 240,
        }
    )
    op = history.invoke("client", "release", version)
    async with make_channel(rig.orchestrator.grpc_target, token=ORCHESTRATOR_TOKEN) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        workflow_id = f"release-{version}-{uuid.uuid4().hex[:6]}"
        await stub.StartWorkflow(
            orchestrator_pb2.StartWorkflowRequest(
                workflow_type="eval_and_promote", input=data, workflow_id=workflow_id
            ),
            timeout=60,
        )
        deadline = time.monotonic() + 300
        while True:
            if traffic and not rig.metrics.traffic.on and (await rig.holders()).get("canary") == version:
                rig.metrics.traffic.on = True
            got = await stub.GetWorkflow(
                orchestrator_pb2.GetWorkflowRequest(workflow_id=workflow_id), timeout=30
            )
            if got.status != orchestrator_pb2.WORKFLOW_STATUS_RUNNING:
                break
            assert time.monotonic() < deadline, f"release of {version} still running"
            await asyncio.sleep(0.3)
    rig.metrics.traffic.on = False
    if got.status != orchestrator_pb2.WORKFLOW_STATUS_COMPLETED:
        history.fail(op, f"{orchestrator_pb2.WorkflowStatus.Name(got.status)} {got.error}")
        raise AssertionError(f"release of {version}: {got.error}")
    result = json_format.MessageToDict(got.result)
    history.ok(op, result.get("decision"))
    return result


async def registry_history(rig: PromotionRig, history: History) -> dict[str, dict[str, float]]:
    """The registry's stage events as operations (``promote-<stage>`` keyed by version, ``ok``;
    a rollback is a ``fail`` of that promotion), and version → stage → when it first entered it
    (s, the registry's clock; ``left canary``: when it first left the canary stage)."""
    entered: dict[str, dict[str, float]] = {}
    for event in await rig.stage_events():
        version = event.model.version
        at = event.created_at.seconds + event.created_at.nanos / 1e9
        if event.action == "promote":
            op = history.invoke("registry", f"promote-{event.to_stage}", version)
            history.ok(op, event.reason[:60])
        elif event.action == "rollback":
            op = history.invoke("registry", f"promote-{event.from_stage}", version)
            history.fail(op, f"rolled back: {event.reason[:80]}")
        stages = entered.setdefault(version, {})
        stages.setdefault(event.to_stage, at)
        if event.from_stage == "canary" and event.to_stage != "canary":
            stages.setdefault("left canary", at)
    return entered


async def converged(
    rig: PromotionRig, timeout_s: float = 60
) -> tuple[dict[str, tuple[str, str, int]], float]:
    """The gateway's aliases once they agree with the registry's holders, and how long that took."""
    started = time.monotonic()
    while True:
        holders = await rig.holders()
        aliases = rig.gateway_aliases()
        production = holders.get("production", "")
        want_canary = holders.get("canary", "")
        ok = (
            aliases.get("production", ("", "", 0))[0] == production
            and aliases.get("forge-chat", ("", "", 0))[0] == production
            and aliases.get("canary", ("", "", 0))[0] == want_canary
            and all(weight == 0 or canary == want_canary for _, canary, weight in aliases.values())
        )
        if ok or time.monotonic() - started > timeout_s:
            return aliases, time.monotonic() - started
        await asyncio.sleep(0.5)


async def play(rig: PromotionRig, name: str, partition: bool) -> None:
    history = History()
    results: dict[str, dict[str, Any]] = {}
    first = await release(rig, history, "base", 0.0, False)  # nothing in production yet: no canary
    assert first["promoted_to"] == ["canary", "production"], first

    async def releases() -> None:
        for version, error, traffic in RELEASES:
            results[version] = await release(rig, history, version, error, traffic)

    if partition:
        running = asyncio.create_task(releases())
        await run_timeline(load_scenario(name), Targets(links={"broker": rig.link}))
        healed = time.monotonic()
        await running
        since_heal = time.monotonic() - healed
    else:
        await releases()
        since_heal = 0.0
    entered = await registry_history(rig, history)
    aliases, settle_s = await converged(rig)
    history.dump(rig.root / f"{name}.history.jsonl")
    by_alias = {alias: stable for alias, (stable, _, _) in aliases.items()}
    split = {f"{alias}~canary": canary for alias, (_, canary, weight) in aliases.items() if weight}
    holders = await rig.holders()
    diverged = [
        Anomaly(
            "alias-diverged",
            alias,
            f"gateway {by_alias.get(alias, '')!r}, registry {holders.get(stage, '')!r}",
        )
        for alias, stage in (("production", "production"), ("forge-chat", "production"), ("canary", "canary"))
        if by_alias.get(alias, "") != holders.get(stage, "")
    ]
    result = verdict(
        history,
        check_aliases(history, "promote-production", {a: v for a, v in by_alias.items() if a != "canary"}),
        check_aliases(
            history, "promote-canary", {**{a: v for a, v in by_alias.items() if a == "canary"}, **split}
        ),
        diverged,
    )
    windows = {
        v: (r.get("canary", {}).get("decided_after_s", 0.0), r.get("canary", {}).get("decision", ""))
        for v, r in results.items()
    }
    in_canary = {}
    for version, stages in entered.items():
        if "canary" in stages and "left canary" in stages:
            in_canary[version] = stages["left canary"] - stages["canary"]
    print(
        f"\nfault {name}: {len(results) + 1} releases, {result.ops_checked} operations checked, "
        f"anomalies {len(result.anomalies)}; decisions and decided_after_s "
        f"{ {v: (d, round(s, 1)) for v, (s, d) in windows.items()} }; time in canary by the registry's "
        f"clock { {v: round(s, 1) for v, s in in_canary.items()} }; "
        + (f"last release done {since_heal:.1f}s after the heal; " if partition else "")
        + f"gateway aliases agreed with the registry {settle_s:.1f}s after the last release"
    )
    result.assert_valid()
    assert [windows[v][1] for v, _, _ in RELEASES] == ["promote", "rollback", "rollback"], windows
    assert holders.get("production") == "same" and "canary" not in holders, holders
    same_s, quiet_s = windows["same"][0], windows["quiet"][0]
    assert same_s < WINDOW_S, f"an identical canary is promoted within the window: {same_s}"
    assert WINDOW_S + EXTENSION_S <= quiet_s < WINDOW_S + EXTENSION_S + SLACK_S, quiet_s
    # No window cut short: each candidate really spent (the registry's clock) at least the time
    # the workflow judged it on in canary, the quiet one the whole window and its extension. (It
    # may spend longer: on loaded cores a workflow task can be retried after Temporal's deadlock
    # detector fires, delaying the decision's record, never the window.)
    for version, (decided_s, _) in windows.items():
        assert in_canary[version] >= decided_s - 1.0, (version, in_canary[version], decided_s)
    assert in_canary["quiet"] >= WINDOW_S + EXTENSION_S - 1.0, in_canary


@pytest.mark.asyncio
async def test_canary_windows_hold_with_the_orchestrator_clock_ahead(rig: PromotionRig) -> None:
    await play(rig, "canary_clock_ahead", partition=False)
    # The skew took: the orchestrator stamps its log lines ten minutes ahead of this process.
    stamps = [
        json.loads(line).get("timestamp", "")
        for line in (rig.root / "orchestrator.log").read_text().splitlines()
        if line.startswith("{")
    ]
    newest = dt.datetime.fromisoformat(max(s for s in stamps if s).replace("Z", "+00:00"))
    assert 300 < (newest - dt.datetime.now(dt.UTC)).total_seconds() < 700, newest


@pytest.mark.asyncio
async def test_promotions_through_a_broker_partition_leave_no_unpromoted_alias(rig: PromotionRig) -> None:
    await play(rig, "promotions_broker_partition", partition=True)
