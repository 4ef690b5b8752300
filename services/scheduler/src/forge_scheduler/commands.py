"""Commands for agents, as domain values: :class:`StartJob`, :class:`PreemptJob`, :class:`CancelJob`.

The scheduler decides them after a commit and hands them to the :class:`~forge_scheduler.hub.AgentHub`;
the API's agent session turns each into its ``AgentSessionResponse`` on the way out.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession

from forge_scheduler.store import JobRow, NodeRow


@dataclass(frozen=True)
class StartJob:
    """Start the job's replica on one node (rank = the node's position in the job's slots)."""

    job: JobRow
    gpu_indices: tuple[int, ...]
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    attempt: int
    submitted_by_admin: bool


@dataclass(frozen=True)
class PreemptJob:
    """Checkpoint within ``grace_seconds``, then stop."""

    job_id: str
    reason: str
    grace_seconds: int


@dataclass(frozen=True)
class CancelJob:
    job_id: str
    reason: str


AgentCommand = StartJob | PreemptJob | CancelJob

ADDRESS_LABEL = "forge.ai/address"


def start_command(job: JobRow, node_name: str, master_addr: str = "127.0.0.1") -> StartJob:
    """The StartJob for the job's replica on ``node_name``; ``master_addr`` is the rank-0 node's
    address (its ``forge.ai/address`` label)."""
    nodes = [node for node, _ in job.slots or []]
    gpus = next(g for node, g in job.slots or [] if node == node_name)
    return StartJob(
        job=job,
        gpu_indices=tuple(int(g) for g in gpus),
        node_rank=nodes.index(node_name),
        num_nodes=len(nodes),
        master_addr=master_addr,
        master_port=master_port(job),
        attempt=job.attempt,
        submitted_by_admin=job.submitted_by_admin,
    )


async def node_addresses(session: AsyncSession) -> dict[str, str]:
    """Node name → the address its agent announced (label ``forge.ai/address``), where set."""
    rows = (await session.scalars(sa.select(NodeRow))).all()
    return {n.name: n.labels[ADDRESS_LABEL] for n in rows if n.labels.get(ADDRESS_LABEL)}


def master_port(job: JobRow) -> int:
    """A rendezvous port for the attempt, spread over 29500-30499 by job id and attempt."""
    digest = hashlib.sha256(f"{job.id}/{job.attempt}".encode()).digest()
    return 29500 + int.from_bytes(digest[:2], "big") % 1000
