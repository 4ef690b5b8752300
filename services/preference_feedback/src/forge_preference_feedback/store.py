"""Preference feedback persistence: the tables, and how the rating hot path runs its transactions.

The hot path (session check, next comparison, preference + outbox event) is written as plain
functions of a synchronous SQLAlchemy ``Connection`` running Core statements built once
(:class:`HotPath`) — "units" — run by a :class:`Transactions`:

- :class:`AsyncTransactions` runs each unit as its own transaction on the service's async engine
  (``AsyncConnection.run_sync``), concurrently — PostgreSQL, or any database;
- :class:`SqliteGroupCommit` runs them on one writer thread with a plain ``sqlite3`` connection.
  Through aiosqlite every statement is a round trip to a worker thread (about 0.25 ms, against
  microseconds for the statement itself) and every commit is an fsync; here a whole unit costs
  one hand-over, and the units that queued up while the previous commit was on disk are
  committed together with one fsync (group commit), each in its own savepoint so one unit's
  failure undoes only that unit. There the units' :class:`HotPath` statements run on the
  ``sqlite3`` connection as SQLAlchemy compiled them once (:class:`PrecompiledConnection`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar, cast

import sqlalchemy as sa
from prometheus_client import Histogram
from sqlalchemy import event
from sqlalchemy.orm import Mapped, mapped_column
from sqlalchemy.sql.expression import ReturnsRows

from forge_kit.db import Base, Database, utcnow
from forge_kit.events import INSERT_OUTBOX_EVENT, SET_OUTBOX_PAYLOAD

T = TypeVar("T")
GROUP_COMMIT_UNITS = Histogram(
    "forge_feedback_group_commit_units",
    "Units of work committed together in one transaction (SQLite writer thread)",
    buckets=(1, 2, 4, 8, 16, 32, 64),
)
GROUP_COMMIT_SECONDS = Histogram(
    "forge_feedback_group_commit_seconds", "Time of one group commit (units and the commit's fsync)"
)


class ComparisonRow(Base):
    """A comparison task: one prompt, two responses in the order raters see them.

    ``gold_choice`` records which side the source labelled better ("A"/"B", empty when unknown),
    for rater-quality checks; raters never see it.
    """

    __tablename__ = "feedback_comparisons"

    id: Mapped[str] = mapped_column(sa.String(40), primary_key=True)
    seq: Mapped[int] = mapped_column(sa.Integer, unique=True)
    source: Mapped[str] = mapped_column(sa.String(128))
    source_key: Mapped[str] = mapped_column(sa.String(255), unique=True)
    prompt: Mapped[str] = mapped_column(sa.Text)
    response_a_id: Mapped[str] = mapped_column(sa.String(40))
    response_a_text: Mapped[str] = mapped_column(sa.Text)
    response_a_model: Mapped[str] = mapped_column(sa.String(255), default="")
    response_b_id: Mapped[str] = mapped_column(sa.String(40))
    response_b_text: Mapped[str] = mapped_column(sa.Text)
    response_b_model: Mapped[str] = mapped_column(sa.String(255), default="")
    gold_choice: Mapped[str] = mapped_column(sa.String(1), default="")
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)
    answer_count: Mapped[int] = mapped_column(sa.Integer, default=0)
    """Preferences recorded for it, kept in the preference's transaction; with ``seq`` it is the
    index that assignment walks to find the next open item."""

    __table_args__ = (sa.Index("ix_feedback_comparisons_answer_count_seq", "answer_count", "seq"),)


class AssignmentRow(Base):
    """A comparison handed to a rater; reserved for them until ``expires_at``, which the rater's
    answer brings forward to the time of the answer (the row stays as the proof of assignment)."""

    __tablename__ = "feedback_assignments"

    comparison_id: Mapped[str] = mapped_column(sa.ForeignKey("feedback_comparisons.id"), primary_key=True)
    rater_id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    assigned_at: Mapped[dt.datetime] = mapped_column(sa.DateTime)
    expires_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, index=True)


class PreferenceRow(Base):
    """A rater's answer to a comparison; append-only, one per (comparison, rater)."""

    __tablename__ = "feedback_preferences"
    __table_args__ = (
        sa.UniqueConstraint("comparison_id", "rater_id", name="uq_feedback_preferences_comparison_rater"),
    )

    id: Mapped[str] = mapped_column(sa.String(40), primary_key=True)
    comparison_id: Mapped[str] = mapped_column(sa.ForeignKey("feedback_comparisons.id"), index=True)
    rater_id: Mapped[str] = mapped_column(sa.String(128), index=True)
    choice: Mapped[int] = mapped_column(sa.Integer)
    confidence: Mapped[float] = mapped_column(sa.Float)
    rationale: Mapped[str] = mapped_column(sa.Text, default="")
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)
    shown_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime, nullable=True, default=None)
    """When the comparison was handed to the rater: ``created_at - shown_at`` is the time spent."""
    ui_version: Mapped[str] = mapped_column(sa.String(32), default="")
    """Which client recorded it (the web UI's version, or ``grpc``)."""


class RewardModelRow(Base):
    """A registered reward-model version. Immutable but for ``status`` (and who changed it when):
    the registry has no other update path."""

    __tablename__ = "feedback_reward_models"

    name: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    version: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    uri: Mapped[str] = mapped_column(sa.Text)
    """Checkpoint location: object-store URI of the Hugging Face files."""
    metrics: Mapped[dict[str, float]] = mapped_column(sa.JSON, default=dict)
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow, index=True)
    status: Mapped[str] = mapped_column(sa.String(16), default="candidate", index=True)
    """``candidate`` when registered; an admin makes it ``active`` or ``retired``."""
    snapshot_id: Mapped[str] = mapped_column(sa.String(128), default="")
    """The training snapshot (``forge feedback export``) it was trained on."""
    backbone: Mapped[str] = mapped_column(sa.String(255), default="")
    heldout_accuracy: Mapped[float | None] = mapped_column(sa.Float, nullable=True, default=None)
    heldout_ci95_low: Mapped[float | None] = mapped_column(sa.Float, nullable=True, default=None)
    heldout_ci95_high: Mapped[float | None] = mapped_column(sa.Float, nullable=True, default=None)
    heldout_n: Mapped[int | None] = mapped_column(sa.Integer, nullable=True, default=None)
    heldout_interval: Mapped[str] = mapped_column(sa.String(16), default="")
    """How the interval was computed: ``wilson`` or ``bootstrap``."""
    registered_by: Mapped[str] = mapped_column(sa.String(128), default="")
    status_changed_at: Mapped[dt.datetime | None] = mapped_column(sa.DateTime, nullable=True, default=None)
    status_changed_by: Mapped[str] = mapped_column(sa.String(128), default="")


class RlhfRoundRow(Base):
    """One round of the orchestrator's RLHF workflow as it last reported it (``rounds.py``)."""

    __tablename__ = "feedback_rlhf_rounds"

    workflow_id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    round: Mapped[int] = mapped_column(sa.Integer, primary_key=True)
    status: Mapped[str] = mapped_column(sa.String(16))
    """``running``, ``completed``, ``stopped`` or ``rejected``."""
    step: Mapped[str] = mapped_column(sa.String(255), default="")
    snapshot_id: Mapped[str] = mapped_column(sa.String(128), default="")
    reward_model: Mapped[str] = mapped_column(sa.String(200), default="")
    """``name:version`` of the reward model the round is pinned to."""
    policy_uri: Mapped[str] = mapped_column(sa.Text, default="")
    reason: Mapped[str] = mapped_column(sa.Text, default="")
    metrics: Mapped[dict[str, float]] = mapped_column(sa.JSON, default=dict)
    started_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow, index=True)


class RaterRow(Base):
    """A rater account; ``password_hash`` is an Argon2id hash (never the password)."""

    __tablename__ = "feedback_raters"

    id: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    password_hash: Mapped[str] = mapped_column(sa.String(255))
    is_admin: Mapped[bool] = mapped_column(sa.Boolean, default=False)
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, default=utcnow)


class SessionRow(Base):
    """A logged-in browser session. Only the SHA-256 of the cookie token is stored, so a copy of
    the database cannot be replayed as a login; ``csrf_token`` is the synchroniser token that
    every form of the session must carry."""

    __tablename__ = "feedback_sessions"

    token_hash: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    rater_id: Mapped[str] = mapped_column(sa.ForeignKey("feedback_raters.id"), index=True)
    csrf_token: Mapped[str] = mapped_column(sa.String(64))
    created_at: Mapped[dt.datetime] = mapped_column(sa.DateTime)
    expires_at: Mapped[dt.datetime] = mapped_column(sa.DateTime, index=True)


COMPARISONS = cast(sa.Table, ComparisonRow.__table__)
ASSIGNMENTS = cast(sa.Table, AssignmentRow.__table__)
PREFERENCES = cast(sa.Table, PreferenceRow.__table__)


class HotPath:
    """The statements of the rating hot path, built once with bind parameters.

    Every item handed out and every answer runs these; built per call, SQLAlchemy would spend
    more time constructing each statement and computing its cache key than SQLite spends
    running it. Parameters: ``rid`` (the rater), ``cid`` (the comparison), ``now``, ``k`` (the overlap);
    an UPDATE may not name a parameter after a column.
    """

    _c, _a, _p = COMPARISONS.c, ASSIGNMENTS.c, PREFERENCES.c
    _mine = sa.exists().where(_p.comparison_id == _c.id, _p.rater_id == sa.bindparam("rid"))
    held = (
        sa.select(COMPARISONS)
        .join(ASSIGNMENTS, _a.comparison_id == _c.id)
        .where(_a.rater_id == sa.bindparam("rid"), _a.expires_at > sa.bindparam("now"), ~_mine)
        .order_by(_a.assigned_at, _c.seq)
        .limit(1)
    )
    """The rater's own live lease on an item they have not answered yet."""
    free = (
        sa.select(COMPARISONS)
        .where(
            _c.answer_count < sa.bindparam("k"),
            ~sa.exists().where(
                _a.comparison_id == _c.id,
                _a.rater_id != sa.bindparam("rid"),
                _a.expires_at > sa.bindparam("now"),
            ),
            ~_mine,
        )
        .order_by(_c.answer_count, _c.seq)
        .limit(1)
    )
    """The first open item (by answers, then seq) that no other rater holds a live lease on."""
    _holders = (
        sa.select(_a.comparison_id, sa.func.count().label("n"))
        .where(_a.rater_id != sa.bindparam("rid"), _a.expires_at > sa.bindparam("now"))
        .group_by(_a.comparison_id)
        .subquery()
    )
    held_by_others = (
        sa.select(COMPARISONS)
        .join(_holders, _holders.c.comparison_id == _c.id)
        .where(_c.answer_count + _holders.c.n < sa.bindparam("k"), ~_mine)
        .order_by(_holders.c.n, _c.answer_count, _c.seq)
        .limit(1)
    )
    """Among items other raters hold, one still under the overlap: fewest holders first."""
    renew_lease = (
        sa.update(ASSIGNMENTS)
        .where(_a.comparison_id == sa.bindparam("cid"), _a.rater_id == sa.bindparam("rid"))
        .values(assigned_at=sa.bindparam("lease_from"), expires_at=sa.bindparam("lease_until"))
    )
    insert_lease = sa.insert(ASSIGNMENTS)
    comparison = sa.select(COMPARISONS).where(_c.id == sa.bindparam("cid"))
    answer = sa.select(PREFERENCES).where(
        _p.comparison_id == sa.bindparam("cid"), _p.rater_id == sa.bindparam("rid")
    )
    lease = sa.select(_a.assigned_at, _a.expires_at).where(
        _a.comparison_id == sa.bindparam("cid"), _a.rater_id == sa.bindparam("rid")
    )
    insert_answer = sa.insert(PREFERENCES)
    end_lease = (
        sa.update(ASSIGNMENTS)
        .where(_a.comparison_id == sa.bindparam("cid"), _a.rater_id == sa.bindparam("rid"))
        .values(expires_at=sa.bindparam("lease_until"))
    )
    count_answer = (
        sa.update(COMPARISONS).where(_c.id == sa.bindparam("cid")).values(answer_count=_c.answer_count + 1)
    )
    # The kit's stage_event_sync statements, so that staging an event runs precompiled too.
    insert_event = INSERT_OUTBOX_EVENT
    event_payload = SET_OUTBOX_PAYLOAD

    @classmethod
    def statements(cls) -> list[sa.Executable]:
        """Every statement above (what :class:`PrecompiledConnection` compiles once)."""
        return [v for k, v in vars(cls).items() if not k.startswith("_") and isinstance(v, sa.Executable)]


class PrecompiledRow(tuple[Any, ...]):
    """A row of a precompiled statement: by position, by column key as an attribute, and as
    ``_mapping`` — what the units read of SQLAlchemy's ``Row``."""

    __slots__ = ()
    _keys: ClassVar[dict[str, int]] = {}

    def __getattr__(self, name: str) -> Any:
        try:
            return self[type(self)._keys[name]]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def _mapping(self) -> dict[str, Any]:
        return dict(zip(type(self)._keys, self, strict=True))


@dataclass(frozen=True)
class PrecompiledResult:
    """The rows (fetched at once) and row count of one precompiled execution."""

    rows: list[PrecompiledRow]
    rowcount: int

    def first(self) -> PrecompiledRow | None:
        return self.rows[0] if self.rows else None

    def scalar_one(self) -> Any:
        """The first column of the only row; SQLAlchemy's errors when there is none or several."""
        if not self.rows:
            raise sa.exc.NoResultFound("no row was found when one was required")
        if len(self.rows) > 1:
            raise sa.exc.MultipleResultsFound("multiple rows were found when exactly one was required")
        return self.rows[0][0]


@dataclass(frozen=True)
class _Precompiled:
    """One statement as SQLite runs it: the SQL text, each positional parameter as (name, the
    type's bind processor, constant) — constant is the value of a parameter the statement fixes
    itself (a ``LIMIT``), else ``_FROM_CALL`` — and the row type with each column's result processor."""

    sql: str
    params: tuple[tuple[str, Callable[[Any], Any] | None, Any], ...]
    row: type[PrecompiledRow] | None
    results: tuple[Callable[[Any], Any] | None, ...]


_FROM_CALL = object()


def _precompile(statement: sa.Executable, keys: tuple[str, ...], dialect: sa.Dialect) -> _Precompiled | None:
    """Compile ``statement`` for the parameter names ``keys``, or None when SQLAlchemy must run it
    itself: defaults computed per execution (``insert_prefetch``/``update_prefetch``) or an
    expanding ``IN`` parameter."""
    compiled = cast(Any, cast(sa.ClauseElement, statement).compile(dialect=dialect, column_keys=list(keys)))
    if compiled.insert_prefetch or compiled.update_prefetch or compiled.positiontup is None:
        return None
    params: list[tuple[str, Callable[[Any], Any] | None, Any]] = []
    for name in compiled.positiontup:
        bind = compiled.binds[name]
        if bind.expanding:
            return None
        processor = bind.type.dialect_impl(dialect).bind_processor(dialect)
        params.append((name, processor, _FROM_CALL if name in keys else bind.effective_value))
    columns = list(statement.exported_columns) if isinstance(statement, ReturnsRows) else []
    row = None
    if columns:
        fields = {column.key: i for i, column in enumerate(columns)}
        row = cast(type[PrecompiledRow], type("Row", (PrecompiledRow,), {"__slots__": (), "_keys": fields}))
    results = tuple(column.type.dialect_impl(dialect).result_processor(dialect, None) for column in columns)
    return _Precompiled(compiled.string, tuple(params), row, results)


class PrecompiledConnection:
    """A unit's connection on SQLite's writer thread: :class:`HotPath`'s statements run on the
    ``sqlite3`` connection underneath, compiled once per set of parameter names; anything else
    goes to SQLAlchemy's connection, in the same transaction.

    SQLAlchemy's execution of an already-compiled statement (execution context, parameter and
    result processing, events) took about 25 µs a statement against 2-9 µs for ``sqlite3``
    itself (measured on the hot path's selects), and the hot path runs 16 statements a
    preference: over half of the writer thread's CPU, which bounded the whole service. The
    compiled SQL, the type processors and the row keys are still SQLAlchemy's, so the two paths
    read and write the same values.
    """

    def __init__(self, connection: sa.Connection, plans: _Plans) -> None:
        self.connection = connection
        raw = connection.connection.driver_connection
        if raw is None:
            raise RuntimeError("the SQLite connection is closed")
        self._raw: Any = raw
        self._plans = plans
        self._dbapi_error: type[Exception] = connection.dialect.loaded_dbapi.Error

    def savepoint(self) -> None:
        """Open the savepoint one unit runs in (SQL, not SQLAlchemy's ``begin_nested``: that
        compiled a new statement each time, four a preference)."""
        self._raw.execute("SAVEPOINT forge_unit")

    def release(self, *, undo: bool = False) -> None:
        """Close the unit's savepoint, keeping what it wrote or, with ``undo``, rolling it back."""
        if undo:
            self._raw.execute("ROLLBACK TO forge_unit")
        self._raw.execute("RELEASE forge_unit")

    def execute(
        self, statement: sa.Executable, parameters: dict[str, Any] | None = None
    ) -> PrecompiledResult | sa.CursorResult[Any]:
        values = parameters or {}
        plan = self._plans.get(statement, values, self.connection.dialect)
        if plan is None:
            return self.connection.execute(statement, values)
        args = []
        for name, processor, constant in plan.params:
            value = values[name] if constant is _FROM_CALL else constant
            args.append(value if processor is None else processor(value))
        try:
            cursor = self._raw.execute(plan.sql, args)
            fetched = cursor.fetchall() if plan.row is not None else []
        except self._dbapi_error as exc:  # as SQLAlchemy raises it: IntegrityError and the rest
            raise sa.exc.DBAPIError.instance(plan.sql, args, exc, self._dbapi_error) from exc
        if plan.row is None:
            return PrecompiledResult([], cursor.rowcount)
        rows = [
            plan.row(
                v if process is None else process(v) for v, process in zip(raw, plan.results, strict=True)
            )
            for raw in fetched
        ]
        return PrecompiledResult(rows, cursor.rowcount)


class _Plans:
    """:class:`HotPath`'s statements compiled for SQLite, per set of parameter names, on first use."""

    def __init__(self) -> None:
        self._hot = {id(statement) for statement in HotPath.statements()}
        self._plans: dict[tuple[int, tuple[str, ...]], _Precompiled | None] = {}

    def get(
        self, statement: sa.Executable, values: dict[str, Any], dialect: sa.Dialect
    ) -> _Precompiled | None:
        if id(statement) not in self._hot:
            return None
        key = (id(statement), tuple(sorted(values)))
        if key not in self._plans:
            self._plans[key] = _precompile(statement, key[1], dialect)
        return self._plans[key]


UnitConnection = sa.Connection | PrecompiledConnection
"""What a unit of work is given: SQLAlchemy's connection, or on SQLite's writer thread the
:class:`PrecompiledConnection` over it. Units use ``execute(statement, parameters)`` and, of its
result, ``first()``, ``scalar_one()`` and ``rowcount``."""


class Transactions(Protocol):
    """Runs units of work, each a function of a synchronous connection, as transactions.

    Called by :class:`~forge_preference_feedback.service.FeedbackService` for every call on the
    rating hot path. A unit commits whole or not at all, and its result is handed back only
    once its commit is durable; an exception raised by the unit (or by the commit) is re-raised
    to the caller with nothing of that unit written.
    """

    async def run(self, unit: Callable[[UnitConnection], T], *, serial: bool = False) -> T:
        """Run ``unit`` in a transaction and return what it returned. ``serial`` units never
        overlap one another (every replica of the service included): assignment reads the
        leases and answer counts it then extends, and two raters must not both be handed the
        last open place on an item."""
        ...

    async def close(self) -> None:
        """Finish queued units and release connections."""
        ...


class AsyncTransactions:
    """Each unit is one transaction on the service's async engine (PostgreSQL, or any database).

    Units run concurrently, one pooled connection each; ``serial`` units first take a
    transaction-scoped advisory lock on PostgreSQL (``pg_advisory_xact_lock``: held to commit, so
    serial units of every replica queue on it), elsewhere a lock of this process. A unit the
    database aborts as a deadlock or serialization failure wrote nothing and runs again, up to
    ``retries`` times.

    Not group-committed, unlike SQLite's writer: on PostgreSQL one writer task running every
    queued unit in shared transactions (a savepoint each) is the slower of the two
    (``load/feedback/RESULTS.md``); PostgreSQL's commits are not the limit. One writer serialises every
    statement's round trip where concurrent transactions overlap them, and a savepoint and its
    release cost two round trips per unit, more than the begin and commit they replace.
    """

    def __init__(self, db: Database, *, retries: int = 3) -> None:
        self._db = db
        self._retries = retries
        self._postgres = sa.engine.make_url(db.url).get_backend_name() == "postgresql"
        self._serial = asyncio.Lock()

    async def run(self, unit: Callable[[UnitConnection], T], *, serial: bool = False) -> T:
        for attempt in range(self._retries + 1):
            try:
                local = self._serial if serial and not self._postgres else contextlib.nullcontext()
                async with local, self._db.engine.begin() as connection:
                    if serial and self._postgres:
                        await connection.execute(_PG_SERIAL_LOCK, {"key": SERIAL_LOCK_KEY})
                    return await connection.run_sync(unit)
            except sa.exc.DBAPIError as exc:
                if not (_retryable(exc) and attempt < self._retries):
                    raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def close(self) -> None:
        return None


#: The advisory lock serial units hold on PostgreSQL (any 64-bit key no other code uses).
SERIAL_LOCK_KEY = 0x666F_7267_6566_6231  # "forgefb1"
_PG_SERIAL_LOCK = sa.text("SELECT pg_advisory_xact_lock(:key)")

#: SQLSTATEs after which the whole transaction may simply run again: serialization failure, deadlock.
_RETRYABLE_SQLSTATES = frozenset({"40001", "40P01"})


def _retryable(exc: sa.exc.DBAPIError) -> bool:
    orig = exc.orig
    code = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    return code in _RETRYABLE_SQLSTATES


@dataclass
class _Job:
    unit: Callable[[UnitConnection], Any]
    future: asyncio.Future[Any]


def _settle(future: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if future.cancelled():
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


class SqliteGroupCommit:
    """One writer thread over a synchronous ``sqlite3`` connection, with group commit.

    The thread takes every unit queued (up to ``max_batch``), opens one ``BEGIN IMMEDIATE``
    transaction (the write lock up front, so two writers wait on each other instead of failing
    to upgrade a read lock), runs each unit in a ``SAVEPOINT`` (an exception rolls back that unit
    alone and goes to its caller), commits once — one fsync, ``synchronous=FULL`` as SQLite's WAL
    default keeps it, so an acknowledged answer survives a power cut — and only then answers
    the callers. If the commit fails every unit of the batch gets the error: none was written.
    """

    def __init__(self, url: str, *, max_batch: int = 64) -> None:
        sync_url = sa.engine.make_url(url).set(drivername="sqlite")
        if sync_url.get_backend_name() != "sqlite":
            raise ValueError(f"SqliteGroupCommit needs a SQLite URL, not {url!r}")
        self._engine = sa.create_engine(
            sync_url, connect_args={"timeout": 30, "check_same_thread": False}, poolclass=sa.pool.StaticPool
        )
        event.listen(self._engine, "connect", _sqlite_connect)
        event.listen(self._engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN IMMEDIATE"))
        self._max_batch = max_batch
        self._plans = _Plans()
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    async def run(self, unit: Callable[[UnitConnection], T], *, serial: bool = False) -> T:
        """Every unit is serial here: one thread writes."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._start()
        self._queue.put(_Job(unit, future))
        return await future

    async def close(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            await asyncio.to_thread(thread.join)
        self._engine.dispose()

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="feedback-sqlite-writer", daemon=True)
                self._thread.start()

    def _work(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            stop = False
            while len(batch) < self._max_batch:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    stop = True
                    break
                batch.append(job)
            self._run_batch(batch)
            if stop:
                return

    def _run_batch(self, batch: list[_Job]) -> None:
        outcomes: list[tuple[bool, Any]] = []
        GROUP_COMMIT_UNITS.observe(len(batch))
        started = time.perf_counter()
        try:
            with self._engine.connect() as connection, connection.begin():
                unit_connection = PrecompiledConnection(connection, self._plans)
                for job in batch:
                    unit_connection.savepoint()
                    try:
                        value = job.unit(unit_connection)
                    except Exception as exc:  # noqa: BLE001 - handed to the unit's caller
                        unit_connection.release(undo=True)
                        outcomes.append((False, exc))
                    else:
                        unit_connection.release()
                        outcomes.append((True, value))
        except Exception as exc:  # noqa: BLE001 - the commit failed: no unit of the batch was written
            outcomes = [(False, exc)] * len(batch)
        GROUP_COMMIT_SECONDS.observe(time.perf_counter() - started)
        for job, (ok, value) in zip(batch, outcomes, strict=True):
            with contextlib.suppress(RuntimeError):  # the caller's loop is gone (shutdown)
                job.future.get_loop().call_soon_threadsafe(_settle, job.future, ok, value)


def _sqlite_connect(dbapi_connection: Any, _record: object) -> None:
    # Transactions are begun explicitly (BEGIN IMMEDIATE above); pysqlite's own implicit BEGIN
    # would break savepoints.
    dbapi_connection.isolation_level = None
    for pragma in ("journal_mode=WAL", "busy_timeout=30000", "foreign_keys=ON"):
        dbapi_connection.execute(f"PRAGMA {pragma}")


def open_transactions(db: Database, *, group_commit: bool = True) -> Transactions:
    """Group commit on a writer thread for SQLite (unless ``group_commit`` is false); a concurrent
    transaction per unit on the async engine for anything else (see :class:`AsyncTransactions`)."""
    if group_commit and sa.engine.make_url(db.url).get_backend_name() == "sqlite":
        return SqliteGroupCommit(db.url)
    return AsyncTransactions(db)
