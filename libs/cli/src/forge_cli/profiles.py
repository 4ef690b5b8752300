"""``forge up --profile``: which platform ``forge up`` runs on this machine.

- ``dev`` (the default, ``make up``): every service on its embedded stand-ins (SQLite per service,
  no Redis, the in-process Qdrant Edge index), state under ``var/``, the table's ports.
- ``prod-like``: every service against PostgreSQL and Redis (already running on this machine),
  the retriever on its Qdrant server backend, MLflow on PostgreSQL; the service settings are
  :func:`forge_cli.platform.production_env`, the very function the Compose file and the
  Kubernetes manifests are generated from, so the two cannot drift. It runs beside a ``dev``
  platform: its state is under ``var/prod-like/var/``, its ports are the table's plus
  :data:`PROD_LIKE_PORT_OFFSET`, its databases are named ``prodlike_forge_<service>``.

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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from forge_cli.platform import INFRA, Backing, Infra, ServiceSpec, database_name

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
        """Every database this profile's services and MLflow use (none for ``dev``)."""
        if self.backing is None:
            return []
        return [*(PROD_LIKE_DATABASE_PREFIX + database_name(s) for s in rows), _mlflow_db()]


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


async def ensure_databases(profile: Profile, rows: Iterable[ServiceSpec]) -> list[str]:
    """Create the profile's missing databases on its PostgreSQL server; the names created."""
    names = profile.databases(rows)
    if not names:
        return []
    import asyncpg

    try:
        return await _create_missing(f"postgresql://{profile.postgres}/postgres", names)
    except (OSError, asyncpg.PostgresError) as exc:
        raise BackingUnavailable(f"PostgreSQL at {profile.postgres}: {exc}") from exc


async def _create_missing(admin_url: str, names: list[str]) -> list[str]:
    import asyncpg

    conn = await asyncpg.connect(admin_url)
    try:
        existing = {r["datname"] for r in await conn.fetch("SELECT datname FROM pg_database")}
        created = []
        for name in names:
            if name not in existing:
                # Names come from the platform table and a fixed prefix, never from input.
                await conn.execute(f'CREATE DATABASE "{name}"')
                created.append(name)
        return created
    finally:
        await conn.close()
