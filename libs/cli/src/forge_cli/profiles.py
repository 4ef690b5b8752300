"""``forge up --profile``: which platform ``forge up`` runs on this machine.

- ``dev`` (the default, ``make up``): every service on its embedded stand-ins (SQLite per service,
  no Redis, the in-process Qdrant Edge index), state under ``var/``, the table's ports.
- ``prod-like``: every service against PostgreSQL and Redis (already running on this machine),
  the retriever on its Qdrant server backend, MLflow on PostgreSQL; the service settings are
  :func:`forge_cli.platform.production_env`, the very function the Compose file and the
  Kubernetes manifests are generated from, so the two cannot drift. It runs beside a ``dev``
  platform: its state is under ``var/prod-like/var/``, its ports are the table's plus
  :data:`PROD_LIKE_PORT_OFFSET`, its databases are named ``prodlike_forge_<service>`` and are
  paired with its state folder (:func:`pair_databases`).

Where PostgreSQL, Redis and Qdrant are: ``FORGE_PROD_LIKE_POSTGRES`` (``user@host:port``,
default ``postgres@127.0.0.1:5432``), ``FORGE_PROD_LIKE_REDIS_URL`` (default
``redis://127.0.0.1:6379/2``) and ``FORGE_PROD_LIKE_QDRANT_URL`` (a Qdrant server,
``http://host:6333``; default qdrant-client's local mode in the retriever's data folder, for
machines without a Qdrant server).
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from forge_cli.platform import INFRA, Backing, Infra, ServiceSpec, database_name, started

if TYPE_CHECKING:
    import asyncpg

PROFILES = ("dev", "prod-like")
PROD_LIKE_PORT_OFFSET = 100
PROD_LIKE_INFRA = Infra(kafka_port=19192, temporal_port=7333, temporal_ui_port=8333, mlflow_port=8160)
PROD_LIKE_DATABASE_PREFIX = "prodlike_"
_SERVER = re.compile(r"^[A-Za-z0-9_.-]+@[A-Za-z0-9_.-]+:\d{1,5}$")


@dataclass(frozen=True)
class Profile:
    """How ``forge up`` runs the platform here."""

    name: str
    root: Path
    """The state root: ``<root>/var`` holds pid files, logs, secrets, data, objects."""
    infra: Infra = INFRA
    port_offset: int = 0
    backing: Backing | None = None
    """Production-shaped backing services; None: the embedded stand-ins."""
    postgres: str = ""
    """``user@host:port`` of the PostgreSQL server the databases are created on."""
    mlflow_store: str = ""
    """The MLflow server's backend store URI; empty: SQLite under ``var/mlflow``."""

    def table(self, rows: Iterable[ServiceSpec]) -> tuple[ServiceSpec, ...]:
        """``rows`` on this profile's ports."""
        return tuple(
            dataclasses.replace(
                s, grpc_port=s.grpc_port + self.port_offset, http_port=s.http_port + self.port_offset
            )
            for s in rows
        )

    def databases(self, rows: Iterable[ServiceSpec]) -> list[str]:
        """Every database this profile's started services (:func:`~forge_cli.platform.started`)
        and MLflow use (none for ``dev``)."""
        if self.backing is None:
            return []
        return [*(PROD_LIKE_DATABASE_PREFIX + database_name(s) for s in started(rows)), _mlflow_db()]


def _mlflow_db() -> str:
    return f"{PROD_LIKE_DATABASE_PREFIX}forge_mlflow"


def resolve(name: str, repo_root: Path, env: Mapping[str, str] | None = None) -> Profile:
    """The profile called ``name`` for the checkout at ``repo_root``; unknown names raise."""
    env = os.environ if env is None else env
    if name == "dev":
        return Profile("dev", repo_root, Infra.from_env())
    if name != "prod-like":
        raise ValueError(f"unknown profile {name!r}: one of {', '.join(PROFILES)}")
    root = repo_root / "var" / "prod-like"
    postgres = env.get("FORGE_PROD_LIKE_POSTGRES", "postgres@127.0.0.1:5432")
    if not _SERVER.match(postgres):
        raise ValueError(f"FORGE_PROD_LIKE_POSTGRES must be user@host:port, not {postgres!r}")
    redis_url = env.get("FORGE_PROD_LIKE_REDIS_URL", "redis://127.0.0.1:6379/2")
    if not redis_url.startswith(("redis://", "rediss://")):
        raise ValueError(f"FORGE_PROD_LIKE_REDIS_URL must be redis(s)://…, not {redis_url!r}")
    qdrant_url = (
        env.get("FORGE_PROD_LIKE_QDRANT_URL") or f"local:{root / 'var' / 'data' / 'retriever' / 'qdrant'}"
    )
    backing = Backing(
        database_url=f"postgresql+asyncpg://{postgres}/{PROD_LIKE_DATABASE_PREFIX}{{database}}",
        redis_url=redis_url,
        qdrant_url=qdrant_url,
    )
    return Profile(
        "prod-like",
        root,
        PROD_LIKE_INFRA,
        PROD_LIKE_PORT_OFFSET,
        backing,
        postgres,
        # MLflow's SQLAlchemy store through psycopg2 (installed with the orchestrator).
        f"postgresql+psycopg2://{postgres}/{_mlflow_db()}",
    )


class BackingUnavailable(RuntimeError):
    """The profile's PostgreSQL server cannot be reached or refuses to create a database."""


#: The file under a profile's state root that pairs it with its databases (a random id; each
#: database's comment carries the same id and the root's path).
STATE_ID_FILE = Path("var") / "state-id"
_TAG = "forge-state"


@dataclass(frozen=True)
class Databases:
    """What :func:`ensure_databases` did."""

    created: list[str]
    reset: list[str]
    """Databases dropped and created again: not paired with this state folder, and no other
    platform connected to them (see :func:`pair_databases`)."""


async def ensure_databases(profile: Profile, rows: Iterable[ServiceSpec]) -> Databases:
    """The profile's databases, created where missing and paired with its state folder
    (:func:`pair_databases`); where stale ones were reset, the profile's Redis keys go too."""
    names = profile.databases(rows)
    if not names:
        return Databases([], [])
    import asyncpg

    try:
        done = await pair_databases(f"postgresql://{profile.postgres}/postgres", names, profile.root)
    except (OSError, asyncpg.PostgresError) as exc:
        raise BackingUnavailable(f"PostgreSQL at {profile.postgres}: {exc}") from exc
    if done.reset and profile.backing is not None:
        await clear_redis(profile.backing.redis_url)
    return done


async def pair_databases(admin_url: str, names: list[str], root: Path) -> Databases:
    """Create the databases ``names`` that are missing, paired with the state folder ``root``.

    A platform's state is in two places, its folder (checkpoints, datasets, logs) and its
    databases, whose rows name files in the folder. Each database's comment records the folder and
    a random id kept in ``root/var/state-id``. A database that is not paired with this folder
    (the folder was removed, as on a fresh clone, or the database was made before pairing) names
    files that no longer exist: it is dropped and created empty, and listed in ``reset``. So is
    one paired with another checkout's folder whose platform is stopped (one PostgreSQL holds one
    prod-like state; the last checkout started owns it). One that another checkout's platform is
    connected to is refused (:class:`BackingUnavailable`), nothing dropped.
    """
    import asyncpg

    state_id = _read_id(root)
    fresh = not state_id
    if fresh:
        state_id = secrets.token_hex(8)
    tag = f"{_TAG} {state_id} {root.resolve()}"
    conn = await asyncpg.connect(admin_url)
    try:
        rows = await conn.fetch(
            "SELECT datname, shobj_description(oid, 'pg_database') AS tag FROM pg_database"
        )
        existing = {r["datname"]: r["tag"] or "" for r in rows}
        stale = []
        for name in names:
            theirs = _parse_tag(existing.get(name, ""))
            if name not in existing or (not fresh and theirs is not None and theirs[0] == state_id):
                continue
            if theirs is not None and theirs[1] != root.resolve() and await _in_use(conn, name):
                raise BackingUnavailable(
                    f"database {name} is in use by the platform at {theirs[1]}, not {root}: stop "
                    "that platform (forge down there), or point FORGE_PROD_LIKE_POSTGRES at "
                    "another server"
                )
            stale.append(name)
        # Names come from the platform table and a fixed prefix, never from input.
        for name in stale:
            await conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        created = []
        for name in names:
            if name not in existing or name in stale:
                await conn.execute(f'CREATE DATABASE "{name}"')
                if name not in stale:
                    created.append(name)
            quoted = tag.replace("'", "''")
            await conn.execute(f"COMMENT ON DATABASE \"{name}\" IS '{quoted}'")
    finally:
        await conn.close()
    if fresh:
        marker = root / STATE_ID_FILE
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(state_id + "\n")
    return Databases(created, stale)


async def _in_use(conn: asyncpg.Connection, name: str) -> bool:
    """Whether a session other than ``conn`` is connected to the database ``name``."""
    count = await conn.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()", name
    )
    return count > 0


def _parse_tag(tag: str) -> tuple[str, Path] | None:
    """(state id, state folder) of a database's comment; None for a database without them."""
    parts = tag.split(" ", 2)
    return (parts[1], Path(parts[2])) if len(parts) == 3 and parts[0] == _TAG else None


def _read_id(root: Path) -> str:
    """The state id kept in the folder ``root``; empty when there is none."""
    try:
        return (root / STATE_ID_FILE).read_text().strip()
    except OSError:
        return ""


async def clear_redis(url: str, prefix: str = "forge:") -> int:
    """Delete the keys under ``prefix`` in the Redis database at ``url``; how many. The services'
    caches there hold answers of the models a reset database named."""
    import redis.asyncio as redis

    client = redis.from_url(url)
    try:
        deleted = 0
        batch: list[bytes] = []
        async for key in client.scan_iter(match=f"{prefix}*", count=500):
            batch.append(key)
            if len(batch) >= 500:
                deleted += await client.delete(*batch)
                batch = []
        if batch:
            deleted += await client.delete(*batch)
        return deleted
    finally:
        await client.aclose()
