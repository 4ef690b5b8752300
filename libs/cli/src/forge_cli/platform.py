"""The local platform as data: which services exist, their ports, and whom each one calls.

Every service rejects a ``FORGE_<NAME>_*`` variable it does not declare, so the environment
built here must match each service's settings class exactly. That is why the wiring is one
declarative table (:data:`SERVICES`) rather than code: when a service adds or drops a
dependency, its author changes one line here.

How a row becomes environment variables (``<NAME>`` is the caller, ``<T>`` the callee, upper case):

- every service: ``GRPC_PORT``, ``HTTP_PORT``, ``AUTH_TOKEN`` (its own token), ``DATA_DIR``
  (``var/data/<name>``), ``OBJECT_STORE_URL`` (``var/objects``), ``KAFKA_BOOTSTRAP``, ``LOG_JSON``,
  ``EVENT_SIGNING_KEY`` (its own event key; local copies share their service's) and
  ``EVENT_VERIFY_KEYS`` (every service's public event key);
- ``generated``: settings filled with a secret generated for this service and kept in the secrets
  store (``<name>.<SETTING>``), e.g. the gateway's bootstrap API key;
- ``grpc("t")``: ``<T>_TARGET=127.0.0.1:<t's gRPC port>`` and ``<T>_TOKEN=<t's token>``;
- ``http("t")``: ``<T>_URL=http://127.0.0.1:<t's HTTP port>`` and ``<T>_TOKEN=<t's token>``;
- ``temporal=True``: ``TEMPORAL_TARGET=127.0.0.1:7233``;
- ``tracking=True``: ``MLFLOW_URI=http://127.0.0.1:8060`` (the MLflow tracking server);
- ``extra``: literal ``KEY: value`` pairs; ``{root}`` in a value becomes the repository root;
- ``local``: like ``extra`` but only for ``forge up`` on this machine (not compose or Kubernetes);
  ``{instance}`` in a value becomes the copy's number, ``{checkout}`` the checkout this CLI runs
  from (where ``make install`` built ``.venv-vllm``; ``{root}`` is a profile's state root);
- ``production``: settings every production-shaped deployment gives the service (Compose,
  Kubernetes, ``forge up --profile prod-like``) on top of its database and Redis
  (:func:`production_env`); ``{qdrant}``, ``{qdrant_shards}``, ``{qdrant_replicas}`` in a
  value become that deployment's Qdrant URL and collection layout;
- ``instances``: how many copies ``forge up`` runs here (three trainer agents stand in for three
  nodes); copy n ≥ 2 is named ``<name>_<n>``, listens on both ports + 10·(n-1) and keeps the
  service's package and settings prefix (:func:`local_table`). 0: a service of Compose and
  Kubernetes that ``forge up`` does not run (its row stays in the table, for the wiring of its
  callers' settings; :func:`started` leaves it out).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from forge_kit.eventauth import EventSigner
from forge_kit.paths import find_repo_root

HOST = "127.0.0.1"


@dataclass(frozen=True)
class Call:
    """One service calling another: the caller declares ``<target>_target`` or ``_url``, and ``_token``."""

    target: str
    kind: Literal["grpc", "http"] = "grpc"


def grpc(target: str) -> Call:
    """The caller reaches ``target`` over gRPC: ``<TARGET>_TARGET`` (host:port) + ``<TARGET>_TOKEN``."""
    return Call(target, "grpc")


def http(target: str) -> Call:
    """The caller reaches ``target`` over HTTP: ``<TARGET>_URL`` (http://host:port) + ``<TARGET>_TOKEN``."""
    return Call(target, "http")


@dataclass(frozen=True)
class ServiceSpec:
    """One row of the platform table."""

    name: str
    grpc_port: int
    http_port: int
    calls: tuple[Call, ...] = ()
    temporal: bool = False
    tracking: bool = False
    """The service records experiments in the platform's MLflow server (``MLFLOW_URI``)."""
    extra: Mapping[str, str] = field(default_factory=dict)
    local: Mapping[str, str] = field(default_factory=dict)
    production: Mapping[str, str] = field(default_factory=dict)
    """Settings of production-shaped deployments only (see :func:`production_env`)."""
    instances: int = 1
    generated: tuple[str, ...] = ()
    """Settings whose value is a secret generated once for this service (no default exists)."""
    package: str = ""
    """The service this row runs, when the row is a local copy (``trainer_agent_2``)."""
    instance: int = 1

    @property
    def service(self) -> str:
        """The service's own name (a local copy's package)."""
        return self.package or self.name

    @property
    def module(self) -> str:
        """What ``python -m`` runs."""
        return f"forge_{self.service}"

    @property
    def prefix(self) -> str:
        """The service's settings prefix."""
        return f"FORGE_{self.service.upper()}_"

    @property
    def grpc_target(self) -> str:
        return f"{HOST}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{HOST}:{self.http_port}"


# ---------------------------------------------------------------------------------------------
# THE TABLE. Keep `calls` equal to the `<target>_target` / `<target>_url` fields each service's
# config.py declares; a mismatch makes the service refuse to start (unknown setting) or start
# without an address it needs. Order is start order and display order.
# ---------------------------------------------------------------------------------------------
SERVICES: tuple[ServiceSpec, ...] = (
    ServiceSpec("scheduler", grpc_port=50051, http_port=8051),
    # Three agents on this machine stand in for three nodes of one GPU each (simulated): the main
    # job schedules one torchrun job across two of them, and its model's vLLM replica, placed by
    # the scheduler like any job, holds one GPU while training goes on beside it.
    ServiceSpec(
        "trainer_agent",
        grpc_port=50052,
        http_port=8052,
        calls=(grpc("scheduler"),),
        instances=3,
        local={
            "NODE_NAME": "local-node-{instance}",
            "GPUS": "SIMx1",
            "NODE_GROUP": "local",
            "RUNNER": "torchrun",
            # Jobs run sandboxed: besides the datasets they read the exports of earlier jobs on
            # any agent (a deployment's replicas serve them) and preference snapshots, and vLLM's
            # environment; the rlhf workflow's jobs write objects/rlhf.
            "JOB_READ_PATHS": (
                "{root}/var/data/trainer_agent*/runs,{root}/var/data/preference_feedback/snapshots,"
                "{checkout}/.venv-vllm"
            ),
            "JOB_WRITE_PATHS": "{root}/var/objects/rlhf",
        },
    ),
    # Forge's own engine as a fixed server: Compose and Kubernetes run it (their GPU overlays put
    # vLLM in its place). `forge up` runs none: every model there is served by the vLLM replicas of
    # a deployment the scheduler placed (the main job's `serve` step, and every promotion).
    ServiceSpec("model_server", grpc_port=50054, http_port=8000, instances=0),
    # In production the index lives on a Qdrant server (retriever replicas share it); `make up`
    # keeps the embedded Qdrant Edge.
    ServiceSpec(
        "retriever",
        grpc_port=50055,
        http_port=8055,
        production={
            "INDEX_BACKEND": "qdrant",
            "QDRANT_URL": "{qdrant}",
            "QDRANT_SHARDS": "{qdrant_shards}",
            "QDRANT_REPLICATION_FACTOR": "{qdrant_replicas}",
            # docs/DEPLOY.md: int8 copies of the dense vectors in RAM; originals, payloads and
            # the sparse index memory-mapped from disk.
            "QDRANT_QUANTIZATION": "int8",
            "QDRANT_ON_DISK_VECTORS": "true",
            "QDRANT_ON_DISK_PAYLOAD": "true",
        },
    ),
    ServiceSpec("reranker", grpc_port=50056, http_port=8056),
    ServiceSpec(
        "inference_gateway",
        grpc_port=50053,
        http_port=8080,
        calls=(http("model_server"), grpc("retriever"), grpc("reranker")),
        generated=("BOOTSTRAP_API_KEY",),
        # No fixed replica here (`forge up` runs no model server): the pool is what deployments add.
        local={"MODEL_SERVER_URL": ""},
    ),
    ServiceSpec(
        "eval",
        grpc_port=50057,
        http_port=8057,
        calls=(http("inference_gateway"),),
        # A run eval serves itself (RunSuite's serve_model) is on vLLM, from this checkout's
        # environment, as every model forge up serves.
        local={
            "MODEL_SERVER_ENGINE": "vllm",
            "VLLM_PYTHON": "{checkout}/.venv-vllm/bin/python",
            "VLLM_ENGINE_ARGS": '["--max-num-seqs", "8"]',
        },
    ),
    ServiceSpec("preference_feedback", grpc_port=50058, http_port=8058, calls=(http("inference_gateway"),)),
    ServiceSpec(
        "orchestrator",
        grpc_port=50059,
        http_port=8059,
        calls=(
            grpc("scheduler"),
            grpc("eval"),
            grpc("preference_feedback"),
            grpc("inference_gateway"),
            # Its admin API: deployments add and drain replicas, promotions read the aliases,
            # online RLHF reads the production prompt pool.
            http("inference_gateway"),
            grpc("retriever"),
        ),
        temporal=True,
        tracking=True,
        # The guarded canary watches the gateway's metrics, with the local policy's short window.
        local={
            "GATEWAY_METRICS_URLS": '["{http:inference_gateway}/metrics"]',
            "CANARY_POLICY": "local",
            # The agents run on this machine: replicas start from this checkout's environments
            # (vLLM's own; Forge's for a deployment that names the ``forge`` engine).
            "DEPLOY_VLLM_PYTHON": "{checkout}/.venv-vllm/bin/python",
            "DEPLOY_FORGE_PYTHON": "{checkout}/.venv/bin/python",
            # Every promotion (the main job's eval and rlhf steps, `forge eval promote`, a rollback)
            # starts the version's vLLM replicas on the agents' simulated GPUs, in the main job's
            # team, and drains the version that lost.
            "PROMOTE_DEPLOY": "true",
            "PROMOTE_DEPLOY_ENGINE": "vllm",
            "PROMOTE_DEPLOY_TEAM": "main-job",
            "PROMOTE_DEPLOY_GPU_TYPE": "SIM",
            "PROMOTE_DEPLOY_ENGINE_ARGS": '["--max-num-seqs", "16"]',
        },
    ),
)


@dataclass(frozen=True)
class Infra:
    """Where the local broker, the Temporal dev server and the MLflow tracking server listen."""

    kafka_port: int = 19092
    temporal_port: int = 7233
    temporal_ui_port: int = 8233
    temporal_namespace: str = "default"
    mlflow_port: int = 8060

    @property
    def mlflow_uri(self) -> str:
        return f"http://{HOST}:{self.mlflow_port}"

    @property
    def kafka_bootstrap(self) -> str:
        return f"{HOST}:{self.kafka_port}"

    @property
    def temporal_target(self) -> str:
        return f"{HOST}:{self.temporal_port}"

    @property
    def temporal_ui_url(self) -> str:
        return f"http://{HOST}:{self.temporal_ui_port}"

    @classmethod
    def from_env(cls) -> Infra:
        """Defaults, or ``FORGE_LOCAL_KAFKA_PORT`` / ``_TEMPORAL_PORT`` / ``_TEMPORAL_UI_PORT`` /
        ``_MLFLOW_PORT`` when set.

        Only for running a second platform beside the usual one (tests); services still read the
        broker and Temporal addresses from the environment ``service_env`` builds.
        """
        env = os.environ
        return cls(
            kafka_port=int(env.get("FORGE_LOCAL_KAFKA_PORT", cls.kafka_port)),
            temporal_port=int(env.get("FORGE_LOCAL_TEMPORAL_PORT", cls.temporal_port)),
            temporal_ui_port=int(env.get("FORGE_LOCAL_TEMPORAL_UI_PORT", cls.temporal_ui_port)),
            mlflow_port=int(env.get("FORGE_LOCAL_MLFLOW_PORT", cls.mlflow_port)),
        )


INFRA = Infra()


def validate(table: Iterable[ServiceSpec]) -> list[str]:
    """Problems in ``table`` (unknown call targets, duplicate names or ports); empty when sound."""
    specs = list(table)
    problems: list[str] = []
    names = [s.name for s in specs]
    problems += [f"service {n!r} listed twice" for n in sorted({n for n in names if names.count(n) > 1})]
    ports = [p for s in specs for p in (s.grpc_port, s.http_port)]
    problems += [f"port {p} used twice" for p in sorted({p for p in ports if ports.count(p) > 1})]
    for spec in specs:
        for call in spec.calls:
            if call.target not in names:
                problems.append(f"{spec.name} calls unknown service {call.target!r}")
            if call.target == spec.name:
                problems.append(f"{spec.name} calls itself")
    return problems


#: ``{http:<service>}`` in a row's ``extra``/``local`` value: that service's HTTP address in this
#: table (so a profile that moves the ports moves the reference too).
_HTTP_REF = re.compile(r"\{http:([a-z_0-9]+)\}")


def declared_keys(spec: ServiceSpec) -> list[str]:
    """The setting names (without prefix) this row says the service declares."""
    keys = [
        "GRPC_PORT",
        "HTTP_PORT",
        "AUTH_TOKEN",
        "DATA_DIR",
        "OBJECT_STORE_URL",
        "KAFKA_BOOTSTRAP",
        "LOG_JSON",
        "EVENT_SIGNING_KEY",
        "EVENT_VERIFY_KEYS",
        *spec.generated,
    ]
    for call in spec.calls:
        stem = call.target.upper()
        keys += [f"{stem}_TARGET" if call.kind == "grpc" else f"{stem}_URL", f"{stem}_TOKEN"]
    if spec.temporal:
        keys.append("TEMPORAL_TARGET")
    if spec.tracking:
        keys.append("MLFLOW_URI")
    keys += [k.upper() for k in (*spec.extra, *spec.local, *spec.production)]
    return keys


def service_env(
    spec: ServiceSpec,
    table: Iterable[ServiceSpec],
    tokens: Mapping[str, str],
    root: Path,
    infra: Infra = INFRA,
    *,
    event_keys: Mapping[str, str],
    generated: Mapping[str, str],
) -> dict[str, str]:
    """The ``FORGE_<NAME>_*`` variables for ``spec``: exactly :func:`declared_keys`, with values.
    ``event_keys`` maps each service to its event signing key, ``generated`` each
    ``<name>.<SETTING>`` of ``generated`` settings to its secret."""

    by_name = {s.name: s for s in table}
    var = root / "var"
    values: dict[str, str] = {
        "GRPC_PORT": str(spec.grpc_port),
        "HTTP_PORT": str(spec.http_port),
        "AUTH_TOKEN": tokens[spec.name],
        "DATA_DIR": str(var / "data" / spec.name),
        "OBJECT_STORE_URL": str(var / "objects"),
        "KAFKA_BOOTSTRAP": infra.kafka_bootstrap,
        "LOG_JSON": "true",
        "EVENT_SIGNING_KEY": event_keys[spec.service],
        "EVENT_VERIFY_KEYS": json.dumps(
            {name: EventSigner.from_secret(name, key).public() for name, key in sorted(event_keys.items())}
        ),
    }
    for setting in spec.generated:
        values[setting] = generated[generated_name(spec, setting)]
    for call in spec.calls:
        callee = by_name[call.target]
        stem = call.target.upper()
        if call.kind == "grpc":
            values[f"{stem}_TARGET"] = callee.grpc_target
        else:
            values[f"{stem}_URL"] = callee.http_url
        values[f"{stem}_TOKEN"] = tokens[call.target]
    if spec.temporal:
        values["TEMPORAL_TARGET"] = infra.temporal_target
    if spec.tracking:
        values["MLFLOW_URI"] = infra.mlflow_uri
    for key, value in {**spec.extra, **spec.local}.items():
        value = value.replace("{root}", str(root)).replace("{instance}", str(spec.instance))
        value = value.replace("{checkout}", str(find_repo_root(Path(__file__).resolve().parent) or root))
        values[key.upper()] = _HTTP_REF.sub(lambda m: by_name[m.group(1)].http_url, value)
    return {f"{spec.prefix}{key}": value for key, value in values.items()}


@dataclass(frozen=True)
class Backing:
    """Where a production-shaped deployment's backing services are, as its services reach them."""

    database_url: str | None
    """Each service's own database: ``{database}`` becomes :func:`database_name`; None when the
    URL comes from elsewhere (a Kubernetes Secret: it carries a password)."""
    redis_url: str
    qdrant_url: str
    qdrant_shards: int = 1
    """Shards per collection on the Qdrant server (one node: 1)."""
    qdrant_replicas: int = 1
    """Copies of each shard (one node: 1)."""


def database_name(spec: ServiceSpec) -> str:
    """The PostgreSQL database of a row (a local copy gets its own: ``forge_trainer_agent_2``)."""
    return f"forge_{spec.name}"


def production_env(spec: ServiceSpec, backing: Backing) -> dict[str, str]:
    """Settings (without prefix) a production-shaped deployment adds to the table's wiring: the
    service's database, Redis, and the row's ``production`` settings. The Compose file and the
    Kubernetes manifests (``deploy/generate.py``) and ``forge up --profile prod-like`` are all
    built from this one function, so what they set cannot drift apart."""
    env = {"REDIS_URL": backing.redis_url}
    if backing.database_url is not None:
        env["DATABASE_URL"] = backing.database_url.replace("{database}", database_name(spec))
    for key, value in spec.production.items():
        env[key.upper()] = (
            value.replace("{qdrant}", backing.qdrant_url)
            .replace("{qdrant_shards}", str(backing.qdrant_shards))
            .replace("{qdrant_replicas}", str(backing.qdrant_replicas))
        )
    return env


#: Settings containers get that ``forge up`` has no counterpart for: the listen address, the
#: transport security of the broker and Temporal (the local stand-ins run without SASL and TLS),
#: the agents' job isolation, off in images that run them unprivileged (``forge up``'s run as root
#: and isolate jobs), the address an agent's replicas are reached at, the engines' interpreters
#: in the agent's image and the gateway metrics the canary reads (Compose's one gateway; ``forge
#: up`` names this checkout's interpreters and its gateway, as ``local`` settings).
CONTAINER_ONLY = frozenset(
    {
        "HOST",
        "JOB_SANDBOX",
        "ADVERTISE_ADDRESS",
        "DEPLOY_VLLM_PYTHON",
        "DEPLOY_FORGE_PYTHON",
        "GATEWAY_METRICS_URLS",
        "KAFKA_SECURITY_PROTOCOL",
        "KAFKA_SASL_MECHANISM",
        "KAFKA_SASL_USERNAME",
        "KAFKA_SASL_PASSWORD",
        "TEMPORAL_TLS_CA_FILE",
        "TEMPORAL_TLS_CERT_FILE",
        "TEMPORAL_TLS_KEY_FILE",
        "TEMPORAL_TLS_SERVER_NAME",
    }
)


def generated_name(spec: ServiceSpec, setting: str) -> str:
    """The secrets store's name of a ``generated`` setting: ``<service>.<SETTING>``."""
    return f"{spec.service}.{setting.upper()}"


def local_table(table: Iterable[ServiceSpec] = SERVICES) -> tuple[ServiceSpec, ...]:
    """``table`` with every row's extra local copies (``instances``) expanded after it."""
    rows: list[ServiceSpec] = []
    for spec in table:
        rows.append(spec)
        for n in range(2, spec.instances + 1):
            rows.append(
                dataclasses.replace(
                    spec,
                    name=f"{spec.name}_{n}",
                    package=spec.service,
                    grpc_port=spec.grpc_port + 10 * (n - 1),
                    http_port=spec.http_port + 10 * (n - 1),
                    instances=1,
                    instance=n,
                )
            )
    return tuple(rows)


def started(rows: Iterable[ServiceSpec]) -> tuple[ServiceSpec, ...]:
    """The rows of ``rows`` that ``forge up`` runs (``instances`` ≥ 1; copies count as started)."""
    return tuple(spec for spec in rows if spec.instances > 0)


def select(names: Iterable[str] | None, table: Iterable[ServiceSpec] = SERVICES) -> tuple[ServiceSpec, ...]:
    """The rows named in ``names`` (all rows when ``None``), in table order; unknown names raise."""
    rows = tuple(table)
    if names is None:
        return rows
    wanted = {n.strip() for n in names if n.strip()}
    unknown = wanted - {s.name for s in rows}
    if unknown:
        raise ValueError(f"unknown service(s): {', '.join(sorted(unknown))}")
    return tuple(s for s in rows if s.name in wanted)
