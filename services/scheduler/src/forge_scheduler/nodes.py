"""Nodes as their agents announce them: registration, heartbeats, loss, and the GPUs jobs hold."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Iterable

import sqlalchemy as sa

from forge_kit import errors
from forge_kit.db import Database
from forge_scheduler.commands import CancelJob, StartJob, node_addresses, start_command
from forge_scheduler.records import NodeRegistration
from forge_scheduler.states import NODE_NOT_READY, NODE_READY, SCHEDULED
from forge_scheduler.store import JobRow, NodeRow


class Nodes:
    """Nodes as their agents announce them: a collaborator of
    :class:`~forge_scheduler.service.SchedulerService` (its ``nodes``). ``wake`` is called after
    a change that may let a job start (a node registered)."""

    def __init__(self, db: Database, clock: Callable[[], dt.datetime], wake: Callable[[], None]) -> None:
        self._db = db
        self._clock = clock
        self._wake = wake

    async def register_node(self, request: NodeRegistration) -> NodeRow:
        """Create or resume a node by name; the node id is stable across reconnects."""
        if not request.node_name:
            raise errors.ValidationError("register_node.node_name", "must not be empty")
        async with self._db.session() as session:
            node = await session.scalar(sa.select(NodeRow).where(NodeRow.name == request.node_name))
            if node is None:
                node = NodeRow(node_id=f"node-{uuid.uuid4().hex[:12]}", name=request.node_name)
                session.add(node)
            node.gpus = [
                {
                    "index": g.index,
                    "type": g.type,
                    "memory_mb": g.memory_mb,
                    "uuid": g.uuid,
                    "pci_bus_id": g.pci_bus_id,
                    "nvlink_group": g.nvlink_group,
                    "pcie_group": g.pcie_group,
                }
                for g in request.gpus
            ]
            node.node_group = request.node_group
            node.rack = request.rack
            node.nvlink_domain = request.nvlink_domain
            node.labels = dict(request.labels)
            node.state = NODE_READY
            node.last_heartbeat_at = self._clock()
            node.running_job_ids = list(request.running_job_ids)
            node.job_isolation = request.job_isolation
        self._wake()
        return node

    async def outstanding_starts(self, node_name: str, running: Iterable[str]) -> list[StartJob]:
        """StartJob commands for jobs placed on the node that its agent does not run: sent
        again when an agent (re)registers, since a command sent while it was away was lost."""
        running = set(running)
        async with self._db.session() as session:
            jobs = (await session.scalars(sa.select(JobRow).where(JobRow.state == SCHEDULED))).all()
            addresses = await node_addresses(session)
            return [
                start_command(job, node_name, addresses.get((job.slots or [[""]])[0][0], "127.0.0.1"))
                for job in jobs
                if job.id not in running and any(node == node_name for node, _ in (job.slots or []))
            ]

    async def stale_runs(self, node_name: str, running: Iterable[str]) -> list[CancelJob]:
        """CancelJob for each job the node's agent says it runs where the scheduler no longer
        has it: a node given up on (silent past the loss timeout, its jobs requeued, maybe onto
        other nodes) that is heard from again still runs them, and left alone they would run
        twice. Asked when an agent registers and with every heartbeat. A replica still stopping
        there (draining) is left to end; a job the scheduler does not know is left alone."""
        running = set(running)
        if not running:
            return []
        async with self._db.session() as session:
            rows = (await session.scalars(sa.select(JobRow).where(JobRow.id.in_(running)))).all()
        stale = []
        for job in sorted(rows, key=lambda j: j.id):
            held = {str(node) for node, _ in [*(job.slots or []), *(job.draining or [])]}
            if node_name not in held:
                why = job.message or "no longer placed on this node"
                stale.append(
                    CancelJob(job.id, f"the scheduler gave up on this replica on {node_name}: {why}")
                )
        return stale

    async def heartbeat(self, node_name: str, running_job_ids: Iterable[str]) -> None:
        async with self._db.session() as session:
            node = await session.scalar(sa.select(NodeRow).where(NodeRow.name == node_name))
            if node is None:
                raise errors.NotFoundError(f"node {node_name!r} is not registered")
            node.last_heartbeat_at = self._clock()
            node.state = NODE_READY
            node.running_job_ids = list(running_job_ids)

    async def mark_node_lost(self, node_name: str) -> None:
        """Called when an agent's session ends: no new work goes to the node. Its jobs keep their
        GPUs until the node misses heartbeats for the loss timeout (the scheduling loop then
        requeues them), so an agent that reconnects quickly loses nothing."""
        async with self._db.session() as session:
            node = await session.scalar(sa.select(NodeRow).where(NodeRow.name == node_name))
            if node is not None:
                node.state = NODE_NOT_READY

    async def used_gpus(self) -> dict[str, set[int]]:
        """GPU indices taken on each node (placed and draining replicas)."""
        async with self._db.session() as session:
            return used_gpu_indices((await session.scalars(holding_jobs())).all())

    async def list_nodes(self, page_size: int, offset: int) -> tuple[list[NodeRow], int]:
        async with self._db.session() as session:
            total = int(await session.scalar(sa.select(sa.func.count()).select_from(NodeRow)) or 0)
            rows = (
                await session.scalars(
                    sa.select(NodeRow).order_by(NodeRow.name).offset(offset).limit(page_size)
                )
            ).all()
        return list(rows), total


def holding_jobs() -> sa.Select[JobRow]:
    """Jobs that hold GPUs: placed (slots) or with replicas still stopping (draining)."""
    return sa.select(JobRow).where(sa.or_(JobRow.slots.is_not(None), JobRow.draining.is_not(None)))


def used_gpu_indices(jobs: Iterable[JobRow]) -> dict[str, set[int]]:
    used: dict[str, set[int]] = {}
    for job in jobs:
        for node, gpus in [*(job.slots or []), *(job.draining or [])]:
            used.setdefault(node, set()).update(int(g) for g in gpus)
    return used
