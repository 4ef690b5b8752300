"""Who started a workflow, and what they may ask of it.

The orchestrator accepts its own service token (an admin) and, through
:class:`SchedulerAuthenticator`, the scheduler's tokens: a team token acts for its team only. A
workflow carries its starter as a :class:`Caller` in its input (so replays see the same identity)
and submits jobs with that caller's rights: a team caller's jobs go to the scheduler as its team's
submission (``on_behalf_of``), never as the orchestrator's admin.
The input alone proves nothing (anyone who reaches Temporal can write one): the front door also
signs a grant over it, and the workers act only for workflows whose grant holds
(:mod:`forge_orchestrator.grant`).

:func:`authorize_start` is the front door's rule:

- a team caller may start ``smoke`` and ``training`` for its own team only, with the default
  interpreter; the kinds that change the model registry's serving stages or name folders the
  orchestrator itself reads (``eval_and_promote``, ``rlhf``) need an admin;
- an interpreter (``python``) is a command name looked up on the nodes' ``PATH`` or an absolute
  path, for everyone: a relative path would be resolved in the job's own folder on the node.
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass

import grpc
import structlog
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

from forge_kit import errors
from forge_kit.grpckit import LazyChannel, Principal

log = structlog.get_logger(__name__)

#: Kinds a team caller may start (for its own team).
TEAM_KINDS = frozenset({"smoke", "training", "sweep"})
DEFAULT_PYTHON = "python"
_COMMAND = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")


@dataclass(frozen=True)
class Caller:
    """The principal that started a workflow: ``role`` is ``admin`` or ``team`` (then ``team``
    is the only team it acts for)."""

    name: str
    role: str
    team: str = ""

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    @property
    def on_behalf_of(self) -> str:
        """The team a job submission acts for: empty for an admin (its own rights)."""
        return "" if self.is_admin else self.team


#: The caller of a workflow whose input names none: started before callers were recorded, or
#: with authentication off.
ADMIN = Caller(name="service", role="admin")


def caller_of(principal: Principal | None) -> Caller:
    """The workflow identity of a gRPC principal (None: authentication is off, an admin)."""
    if principal is None:
        return ADMIN
    return Caller(name=principal.name, role="admin" if principal.is_admin else "team", team=principal.team)


def validate_python(field: str, value: str) -> None:
    """An interpreter a job may start: a command name on the nodes' PATH or an absolute path."""
    if _COMMAND.match(value):
        return
    if not value.startswith("/"):
        raise errors.ValidationError(
            field,
            f"must be a command name on the nodes' PATH (e.g. {DEFAULT_PYTHON!r}) or an absolute path; "
            f"{value[:200]!r} is relative, and a job runs in its own folder on the node: "
            "give the interpreter's absolute path",
        )
    if len(value) > 1024 or any(part in ("", ".", "..") for part in value[1:].split("/")):
        raise errors.ValidationError(field, "must be a normalised absolute path (no '.', '..' or '//')")
    if any(ord(c) < 32 for c in value):
        raise errors.ValidationError(field, "must not contain control characters")


def authorize_start(kind: str, params: object, caller: Caller) -> None:
    """Raise unless ``caller`` may start workflow ``kind`` with ``params`` (see the module)."""
    python = getattr(params, "python", None)
    if isinstance(python, str):
        validate_python("input.python", python)
    if caller.is_admin:
        return
    if kind not in TEAM_KINDS:
        raise errors.PermissionDeniedError(
            f"{kind} workflows need an admin token; {caller.name} may start {', '.join(sorted(TEAM_KINDS))}"
        )
    team = getattr(params, "team", "")
    if team != caller.team:
        raise errors.PermissionDeniedError(
            f"{caller.name} may start workflows for team {caller.team!r} only, not {team!r}"
        )
    if python is not None and python != DEFAULT_PYTHON:
        raise errors.PermissionDeniedError(
            f"choosing the interpreter (input.python={python[:200]!r}) needs an admin token; "
            f"{caller.name}'s jobs run {DEFAULT_PYTHON!r}"
        )


class SchedulerAuthenticator:
    """An authenticator (:data:`forge_kit.grpckit.Authenticator`) for the scheduler's tokens: the
    scheduler's ``GetCaller`` says whom a presented token acts for. Answers are cached by the
    token's hash for ``ttl_s`` (unknown tokens for ``negative_ttl_s``), so a revoked token stops
    working within that time."""

    def __init__(
        self,
        target: str,
        *,
        ttl_s: float = 30.0,
        negative_ttl_s: float = 5.0,
        rpc_timeout_s: float = 5.0,
        max_entries: int = 10_000,
    ) -> None:
        self._ttl_s = ttl_s
        self._negative_ttl_s = negative_ttl_s
        self._rpc_timeout_s = rpc_timeout_s
        self._max_entries = max_entries
        self._cache: dict[str, tuple[float, Principal | None]] = {}
        self._channel = LazyChannel(target, None)

    async def __call__(self, token: str) -> Principal | None:
        key = hashlib.sha256(token.encode()).hexdigest()
        cached = self._cache.get(key)
        now = time.monotonic()
        if cached is not None and cached[0] > now:
            return cached[1]
        principal = await self._ask(token)
        if len(self._cache) >= self._max_entries:
            self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
            if len(self._cache) >= self._max_entries:
                self._cache.clear()
        ttl = self._ttl_s if principal is not None else self._negative_ttl_s
        self._cache[key] = (now + ttl, principal)
        return principal

    async def _ask(self, token: str) -> Principal | None:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(self._channel.get())
        try:
            reply = await stub.GetCaller(
                scheduler_pb2.GetCallerRequest(),
                metadata=(("authorization", f"Bearer {token}"),),
                timeout=self._rpc_timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAUTHENTICATED:
                log.warning("orchestrator.caller_unverified", code=exc.code().name, details=exc.details())
            return None
        if reply.role == "admin":
            return Principal(name=f"scheduler:{reply.name}", role="admin")
        if reply.role == "team" and reply.team:
            return Principal(name=reply.name, role="team", team=reply.team)
        return None

    async def close(self) -> None:
        await self._channel.close()
