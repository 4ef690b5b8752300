"""How the rating hot path's units of work run as transactions.

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
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar, cast

import sqlalchemy as sa
from prometheus_client import Histogram
from sqlalchemy import event
from sqlalchemy.sql.expression import ReturnsRows

from forge_kit.db import Database
from forge_preference_feedback.store import HotPath

T = TypeVar("T")
GROUP_COMMIT_UNITS = Histogram(
    "forge_feedback_group_commit_units",
    "Units of work committed together in one transaction (SQLite writer thread)",
    buckets=(1, 2, 4, 8, 16, 32, 64),
)
GROUP_COMMIT_SECONDS = Histogram(
    "forge_feedback_group_commit_seconds", "Time of one group commit (units and the commit's fsync)"
)


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
