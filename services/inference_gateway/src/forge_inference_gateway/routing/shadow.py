"""Shadow mode: a share of an alias's production requests is also sent to a candidate model, whose
answer is never served, only compared and kept.

An alias's shadow (``PUT /admin/v1/aliases/{alias}/shadow``) names a model and a share; the router
marks the chosen requests (whole answers, sticky per user/session like the canary split). After the
production answer went back to the caller, :meth:`Shadows.mirror` sends the same body to the shadow
model in the background, at the batch admission level so it never takes a slot from live traffic,
and at most ``max_inflight`` at a time (more are dropped and counted). Its latency and errors are in
the gateway's metrics under ``split="shadow"``; the two answers are stored as a pair
(:class:`~forge_inference_gateway.store.ShadowPairRow`, the newest ``max_pairs`` kept) for raters:
``GET /admin/v1/shadow/pairs`` pages through them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

import sqlalchemy as sa
import structlog
from prometheus_client import Counter

from forge_inference_gateway.routing.admission import LEVELS
from forge_inference_gateway.routing.router import Forwarded, Routed, Router
from forge_inference_gateway.store import ShadowPairRow, utcnow
from forge_kit import errors
from forge_kit.db import Database

log = structlog.get_logger(__name__)

SHADOW_DROPPED = Counter(
    "forge_gateway_shadow_dropped_total", "Shadow requests not sent: too many already in flight", ["model"]
)
#: Longest request or answer text kept in a pair (characters).
MAX_TEXT = 16_000
MAX_PAGE = 500


def answer_text(content: bytes) -> str:
    """The generated text of a completion or chat completion (JSON), else the body as text."""
    try:
        body = json.loads(content)
        choice = body["choices"][0]
        text = choice.get("text")
        if text is None:
            text = (choice.get("message") or {}).get("content")
        return str(text or "")[:MAX_TEXT]
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return content.decode("utf-8", "replace")[:MAX_TEXT]


def _request(text: str) -> object:
    """A stored request as JSON, or as the text it was cut to."""
    try:
        return json.loads(text)
    except ValueError:
        return text


class Shadows:
    """Mirrors marked requests and keeps the pairs."""

    def __init__(
        self,
        db: Database,
        router: Router,
        *,
        max_inflight: int = 8,
        max_pairs: int = 10_000,
        timeout_s: float = 60.0,
    ) -> None:
        self._db = db
        self._router = router
        self._max_inflight = max_inflight
        self._max_pairs = max_pairs
        self._timeout_s = timeout_s
        self._tasks: set[asyncio.Task[None]] = set()

    def mirror(self, routed: Routed, production: Forwarded) -> bool:
        """Send ``routed``'s body to its shadow model in the background; False when dropped."""
        if routed.shadow is None:
            return False
        if len(self._tasks) >= self._max_inflight:
            SHADOW_DROPPED.labels(str(routed.shadow)).inc()
            return False
        task = asyncio.create_task(self._run(routed, production))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _run(self, routed: Routed, production: Forwarded) -> None:
        assert routed.shadow is not None
        shadow = dataclasses.replace(
            routed,
            body={**routed.body, "model": str(routed.shadow), "priority": len(LEVELS) - 1},
            model=routed.shadow,
            split="shadow",
            level=len(LEVELS) - 1,
            cache_key=None,
            shadow=None,
        )
        started = time.monotonic()
        status, answer = "", ""
        try:
            reply = await self._router.forward(shadow, time.monotonic() + self._timeout_s)
            status, answer = str(reply.status), answer_text(reply.content)
        except TimeoutError:
            status = "timeout"
        except errors.ForgeError as exc:
            status, answer = "unavailable", str(exc)[:MAX_TEXT]
        except Exception as exc:  # noqa: BLE001 - a shadow's failure never reaches the caller
            status, answer = "error", repr(exc)[:MAX_TEXT]
        try:
            await self._store(routed, production, status, answer, (time.monotonic() - started) * 1000)
        except Exception as exc:  # noqa: BLE001 - logged; the production answer is long gone
            log.warning("shadow.store_failed", error=repr(exc))

    async def _store(
        self, routed: Routed, production: Forwarded, status: str, answer: str, ms: float
    ) -> None:
        request = {k: v for k, v in routed.body.items() if k not in ("model", "priority")}
        async with self._db.session() as session:
            session.add(
                ShadowPairRow(
                    alias=routed.alias or "",
                    path=routed.path,
                    request=json.dumps(request, default=str)[:MAX_TEXT],
                    production_model=str(production.model or routed.model),
                    production_status=production.status,
                    production_answer=answer_text(production.content),
                    shadow_model=str(routed.shadow),
                    shadow_status=status,
                    shadow_answer=answer,
                    shadow_ms=round(ms, 3),
                    created_at=utcnow(),
                )
            )
            await session.flush()
            newest = await session.scalar(sa.select(sa.func.max(ShadowPairRow.id)))
            if newest is not None and newest > self._max_pairs:
                await session.execute(
                    sa.delete(ShadowPairRow).where(ShadowPairRow.id <= newest - self._max_pairs)
                )

    async def pairs(self, alias: str, after_id: int, limit: int) -> list[dict[str, Any]]:
        """Stored pairs after ``after_id``, oldest first (``alias`` empty: every alias's)."""
        if not 0 <= after_id < 2**63:  # the id column is a 64-bit integer
            raise errors.ValidationError("after_id", "must be >= 0 and < 2**63")
        if not 1 <= limit <= MAX_PAGE:
            raise errors.ValidationError("limit", f"must be 1-{MAX_PAGE}")
        query = sa.select(ShadowPairRow).where(ShadowPairRow.id > after_id)
        if alias:
            query = query.where(ShadowPairRow.alias == alias)
        async with self._db.session() as session:
            rows = (await session.scalars(query.order_by(ShadowPairRow.id).limit(limit))).all()
        return [
            {
                "id": r.id,
                "alias": r.alias,
                "path": r.path,
                "request": _request(r.request),
                "production": {
                    "model": r.production_model,
                    "status": r.production_status,
                    "answer": r.production_answer,
                },
                "shadow": {
                    "model": r.shadow_model,
                    "status": r.shadow_status,
                    "answer": r.shadow_answer,
                    "ms": r.shadow_ms,
                },
                "created_at": r.created_at.isoformat() + "Z",
            }
            for r in rows
        ]

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
