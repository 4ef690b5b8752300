"""Production prompts for the RLHF prompt pool, recorded only for tenants that opted in.

A tenant's prompts are used for training only when it allowed it (``Tenant.allow_training``,
off by default; ``PUT /admin/v1/tenants/{name}/training``). For such a tenant each completion or
chat completion's prompt (the raw prompt, or the last user turn of a chat) is recorded once per
distinct text, when it is no longer than ``max_chars``, while the tenant has fewer than
``max_per_tenant`` prompts recorded. For any other tenant nothing is written. The pool
(:meth:`TrainingPrompts.pool`, ``GET /admin/v1/training-prompts``) lists only the prompts of
tenants that allow training at the time of reading, so opting out also withdraws what was
recorded before.

Recording never fails a request: a database error is logged and the request goes on.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import sqlalchemy as sa
import structlog
from prometheus_client import Counter
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from forge_inference_gateway.store import TenantRow, TrainingPromptRow, utcnow
from forge_inference_gateway.tenants.registry import Tenant
from forge_kit import errors
from forge_kit.db import Database

log = structlog.get_logger(__name__)
RECORDED = Counter(
    "forge_gateway_training_prompts_total",
    "Prompts of opted-in tenants considered for the RLHF prompt pool, by outcome",
    ["outcome"],
)
MAX_PAGE = 1000


@dataclass(frozen=True)
class PoolPrompt:
    seq: int
    tenant: str
    prompt: str


def prompt_text(body: dict[str, object]) -> str | None:
    """The prompt of a completion (a string ``prompt``) or chat (the last ``user`` turn's string
    content); None when the body has neither in that form."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in reversed(messages):
            if isinstance(message, dict) and message.get("role") == "user":
                content = message.get("content")
                return content if isinstance(content, str) else None
    return None


class TrainingPrompts:
    """Records opted-in tenants' prompts and lists the pool."""

    def __init__(self, db: Database, *, max_chars: int = 4000, max_per_tenant: int = 10_000) -> None:
        self._db = db
        self._max_chars = max_chars
        self._max_per_tenant = max_per_tenant

    async def record(self, tenant: Tenant, body: dict[str, object]) -> bool:
        """Record the request's prompt if the tenant allows training; True when a row was written."""
        if not tenant.allow_training:
            return False
        text = prompt_text(body)
        if text is None or not text.strip():
            RECORDED.labels("no_prompt").inc()
            return False
        if len(text) > self._max_chars:
            RECORDED.labels("too_long").inc()
            return False
        digest = hashlib.sha256(text.encode()).hexdigest()
        try:
            async with self._db.session() as session:
                held = int(
                    await session.scalar(
                        sa.select(sa.func.count())
                        .select_from(TrainingPromptRow)
                        .where(TrainingPromptRow.tenant_id == tenant.id)
                    )
                    or 0
                )
                if held >= self._max_per_tenant:
                    RECORDED.labels("tenant_full").inc()
                    return False
                seen = await session.scalar(
                    sa.select(TrainingPromptRow.seq).where(
                        TrainingPromptRow.tenant_id == tenant.id, TrainingPromptRow.prompt_hash == digest
                    )
                )
                if seen is not None:
                    RECORDED.labels("duplicate").inc()
                    return False
                session.add(
                    TrainingPromptRow(
                        tenant_id=tenant.id, prompt_hash=digest, prompt=text, created_at=utcnow()
                    )
                )
        except IntegrityError:  # the same prompt recorded concurrently
            RECORDED.labels("duplicate").inc()
            return False
        except SQLAlchemyError as exc:
            RECORDED.labels("error").inc()
            log.warning("gateway.training_prompt_not_recorded", tenant=tenant.name, error=type(exc).__name__)
            return False
        RECORDED.labels("recorded").inc()
        return True

    async def pool(self, *, after: int = 0, limit: int = 100) -> list[PoolPrompt]:
        """Recorded prompts after ``after`` (a ``seq``), oldest first, of tenants that allow
        training now."""
        if not 1 <= limit <= MAX_PAGE:
            raise errors.ValidationError("limit", f"must be between 1 and {MAX_PAGE}")
        if after < 0:
            raise errors.ValidationError("after", "must not be negative")
        async with self._db.session() as session:
            rows = (
                await session.execute(
                    sa.select(TrainingPromptRow.seq, TenantRow.name, TrainingPromptRow.prompt)
                    .join(TenantRow, TenantRow.id == TrainingPromptRow.tenant_id)
                    .where(TenantRow.allow_training.is_(True), TrainingPromptRow.seq > after)
                    .order_by(TrainingPromptRow.seq)
                    .limit(limit)
                )
            ).all()
        return [PoolPrompt(int(seq), name, prompt) for seq, name, prompt in rows]
