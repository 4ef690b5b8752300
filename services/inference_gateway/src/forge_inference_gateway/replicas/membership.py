"""The replica set's membership and its control loop.

:mod:`.pool` holds the pool itself (each replica's load, health and prefix affinity) and picks
a replica for a request; this module keeps the pool's admin-added replicas in the store, so every
gateway replica routes to the same set, and runs the loop that keeps membership, scraped load and
the autoscaling signal current.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable

import sqlalchemy as sa
import structlog

from forge_inference_gateway.replicas.autoscaling import Autoscaler
from forge_inference_gateway.replicas.pool import Replica, ReplicaPool, normalize_url
from forge_inference_gateway.store import UpstreamReplicaRow
from forge_kit import errors
from forge_kit.db import Database

log = structlog.get_logger(__name__)

#: A replica's bearer token: visible ASCII only (it goes into a header), bounded.
_REPLICA_TOKEN = re.compile(r"[\x21-\x7e]{0,512}")


class Replicas:
    """Admin-added replicas (``upstream_replicas``) and the control loop over ``pool``."""

    def __init__(
        self,
        db: Database,
        pool: ReplicaPool,
        autoscaler: Autoscaler,
        *,
        metrics_interval_s: float = 0.5,
        replica_sync_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._db = db
        self.pool = pool
        self._autoscaler = autoscaler
        self._interval_s = metrics_interval_s
        self._sync_s = replica_sync_s
        self._clock = clock
        self._stopping = asyncio.Event()

    async def add_replica(self, url: str, token: str = "") -> Replica:
        """Admin: route to one more model-server replica, on every gateway replica (via the store).
        ``token`` is the credential issued for that replica (empty: none): it is what the gateway
        sends there, never its own model-server token."""
        url = normalize_url(url)
        if not _REPLICA_TOKEN.fullmatch(token):
            raise errors.ValidationError("token", "must be at most 512 visible ASCII characters")
        # A configured replica (MODEL_SERVER_URL) is checked first: it must not get a store row,
        # or every gateway would keep routing to it after the setting drops it.
        if self.pool.has(url):
            raise errors.AlreadyExistsError(f"replica {url} is already in the pool")
        async with self._db.session() as session:
            if await session.get(UpstreamReplicaRow, url) is not None:
                raise errors.AlreadyExistsError(f"replica {url} is already in the pool")
            session.add(UpstreamReplicaRow(url=url, token=token))
        return self.pool.add(url, source="admin", token=token)

    async def remove_replica(self, url: str) -> None:
        """Admin: stop routing to a replica added through the admin API; its requests finish there."""
        replica = self.pool.get(url)
        if replica.source != "admin":
            raise errors.ConflictError(
                f"replica {replica.url} is configured (MODEL_SERVER_URL); change the setting"
            )
        async with self._db.session() as session:
            row = await session.get(UpstreamReplicaRow, replica.url)
            if row is not None:
                await session.delete(row)
        await self.pool.remove(replica.url)

    async def sync_replicas(self) -> None:
        """Make the pool's admin-added replicas those in the store (other gateways may have changed it)."""
        async with self._db.session() as session:
            rows = (await session.execute(sa.select(UpstreamReplicaRow.url, UpstreamReplicaRow.token))).all()
        await self.pool.sync({url: token for url, token in rows})

    async def run_control_loop(self) -> None:
        """Until :meth:`stop`, every ``metrics_interval_s``:

        1. re-read the admin-added replicas from the store (every ``replica_sync_s``);
        2. scrape every due replica's ``/metrics`` (and now and then ``/v1/models``); the pool
           then wakes the admission queues, since capacity may have appeared;
        3. publish the autoscaling signal.
        """
        last_sync = float("-inf")
        while not self._stopping.is_set():
            try:
                # 1. Membership.
                if self._clock() - last_sync >= self._sync_s:
                    await self.sync_replicas()
                    last_sync = self._clock()
                # 2. Load and health.
                await self.pool.refresh()
                # 3. Autoscaling signal.
                self._autoscaler.publish()
            except Exception as exc:  # noqa: BLE001 - one bad round must not stop routing
                log.warning("control_loop.round_failed", error=repr(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self._interval_s)

    async def stop(self) -> None:
        self._stopping.set()
        await self.pool.close()
