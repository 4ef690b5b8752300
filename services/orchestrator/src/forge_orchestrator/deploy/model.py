"""A model deployment: what is served, by which engine, on how many replicas, and the command a
replica runs.

Engine-agnostic: a replica is a scheduler job (``JOB_KIND_INFERENCE``) whose command starts the
engine's OpenAI-compatible server on the port the agent assigns (:data:`SERVE_PORT_PLACEHOLDER`).

- ``forge``: this repository's model server, ``python -m forge_model_server``, serving the model
  folder's parent directory (it names a model after its folder, so the folder must carry the
  model's name); engine arguments are its settings, ``key=value``.
- ``vllm``: vLLM's OpenAI-compatible server (:func:`forge_kit.vllm.server_argv`) run by the
  interpreter of vLLM's own environment; engine arguments are the vLLM flags Forge allows
  (:data:`forge_kit.vllm.ENGINE_ARGS`: nothing that runs code or reads files from outside the
  model folder), and the replica's credential travels in ``VLLM_API_KEY``, not argv.

Each replica is sent a credential of its own deployment (``replica_token``): the engine requires
it, the gateway presents it.
"""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import dataclass, field

from forge_kit import errors, vllm
from forge_kit.jobenv import SERVE_PORT_PLACEHOLDER
from forge_kit.modelref import ModelRef

ENGINES = ("forge", "vllm")
WORKFLOW_PREFIX = "deployment-"
WORKFLOW_TYPE = "deployment"
SCALE_SIGNAL = "scale"
UNDEPLOY_SIGNAL = "undeploy"
STATUS_QUERY = "deployment"
#: Label on every replica job: the deployment it belongs to.
DEPLOYMENT_LABEL = "deployment"
MAX_REPLICAS = 64
MAX_ENGINE_ARGS = 64

_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,50}[a-z0-9])?$")
_FORGE_SETTING = re.compile(r"^[a-z][a-z0-9_]{0,63}=[\x21-\x7e]{0,256}$")
_PATH = re.compile(r"^/[\x21-\x7e]{1,1023}$")
#: Settings the deployment sets itself: where the replica listens, what it serves, its credential.
_FORGE_RESERVED = {"http_port", "grpc_port", "models_dir", "auth_token", "kafka_enabled"}


@dataclass
class DeploymentInput:
    """The deployment workflow's input: a ``forge.orchestrator.v1.DeploymentSpec`` as JSON."""

    name: str
    team: str
    model: str
    model_dir: str
    engine: str = "forge"
    min_replicas: int = 1
    max_replicas: int = 1
    replicas: int = 0
    """Desired at start; 0: ``min_replicas``."""
    gpu_count: int = 1
    gpu_type: str = ""
    engine_args: list[str] = field(default_factory=list)
    autoscale: bool = False
    replica_token: str = ""
    """The credential every replica requires and the gateway presents (set by the service)."""
    forge_python: str = "python"
    """Interpreter of Forge's environment on the nodes (the ``forge`` engine)."""
    vllm_python: str = ".venv-vllm/bin/python"
    """Interpreter of vLLM's environment on the nodes (the ``vllm`` engine)."""
    poll_s: float = 2.0
    """Reconcile period."""
    scale_down_delay_s: float = 60.0
    """With ``autoscale``: how long the gateway's count must stay below the current one before
    replicas are drained (scaling up is immediate), so a lull does not drain a replica a burst
    will need again."""
    ready_timeout_s: float = 600.0
    """A replica that runs but does not answer for this long is replaced."""


def validate_deployment(spec: DeploymentInput) -> None:
    """Refuse a spec no replica could run, naming the field (``spec.…``)."""
    if not _NAME.match(spec.name):
        raise errors.ValidationError(
            "spec.name", "must be lowercase letters, digits and '-', at most 52 characters"
        )
    if not _NAME.match(spec.team):
        raise errors.ValidationError("spec.team", "must be lowercase letters, digits and '-'")
    try:
        ref = ModelRef.parse(spec.model)
    except ValueError as exc:
        raise errors.ValidationError("spec.model", str(exc)) from None
    if not _PATH.match(spec.model_dir) or "/../" in f"{spec.model_dir}/" or "/./" in f"{spec.model_dir}/":
        raise errors.ValidationError("spec.model_dir", "must be an absolute path without '.' or '..' parts")
    if spec.engine not in ENGINES:
        raise errors.ValidationError("spec.engine", f"must be one of {', '.join(ENGINES)}")
    if spec.engine == "forge" and posixpath.basename(spec.model_dir.rstrip("/")) != ref.name:
        raise errors.ValidationError(
            "spec.model_dir",
            f"must be a folder named {ref.name!r}: the forge engine names a model after its folder",
        )
    if not 1 <= spec.min_replicas <= MAX_REPLICAS:
        raise errors.ValidationError("spec.min_replicas", f"must be between 1 and {MAX_REPLICAS}")
    if not spec.min_replicas <= spec.max_replicas <= MAX_REPLICAS:
        raise errors.ValidationError("spec.max_replicas", f"must be between min_replicas and {MAX_REPLICAS}")
    if not spec.min_replicas <= spec.replicas <= spec.max_replicas:
        raise errors.ValidationError("spec.replicas", "must be between min_replicas and max_replicas")
    if not 1 <= spec.gpu_count <= 64:
        raise errors.ValidationError("spec.resources.gpu_count", "must be between 1 and 64")
    if not spec.gpu_type:
        raise errors.ValidationError("spec.resources.gpu_type", "must not be empty")
    if len(spec.engine_args) > MAX_ENGINE_ARGS:
        raise errors.ValidationError("spec.engine_args", f"must be at most {MAX_ENGINE_ARGS}")
    for i, arg in enumerate(spec.engine_args):
        _check_arg(f"spec.engine_args[{i}]", spec.engine, arg)
    if spec.engine == "vllm":
        try:
            vllm.parse_engine_flags(spec.engine_args)
        except vllm.LaunchError as exc:
            raise errors.ValidationError("spec.engine_args", str(exc)) from None


def _check_arg(path: str, engine: str, arg: str) -> None:
    if SERVE_PORT_PLACEHOLDER in arg:
        raise errors.ValidationError(path, "must not name the serving port")
    if engine == "forge":
        if not _FORGE_SETTING.match(arg):
            raise errors.ValidationError(path, "must be a model server setting, key=value")
        if arg.split("=", 1)[0] in _FORGE_RESERVED:
            raise errors.ValidationError(path, f"{arg.split('=', 1)[0]} is set by the deployment")


@dataclass(frozen=True)
class ReplicaCommand:
    command: list[str]
    env: dict[str, str]


def replica_command(spec: DeploymentInput) -> ReplicaCommand:
    """What one replica runs (see the module docstring)."""
    ref = ModelRef.parse(spec.model)
    name = ref.name
    if spec.engine == "vllm":
        # The gateway sends each request's admission level as ``priority`` (batch work such as RLHF
        # sampling is 1), which vLLM refuses unless it schedules by priority.
        args = {**vllm.parse_engine_flags(spec.engine_args), "scheduling_policy": "priority"}
        # The gateway sends a pinned version upstream as ``name:version``: the replica answers to it.
        pinned = [str(ref)] if ref.version else []
        command = vllm.server_argv(
            spec.vllm_python, spec.model_dir, name, "0.0.0.0", SERVE_PORT_PLACEHOLDER, args, pinned
        )
        return ReplicaCommand(command, vllm.server_env({}, api_key=spec.replica_token))
    env = {f"FORGE_MODEL_SERVER_{k.upper()}": v for k, v in (a.split("=", 1) for a in spec.engine_args)}
    env.update(
        FORGE_MODEL_SERVER_HTTP_PORT=SERVE_PORT_PLACEHOLDER,
        FORGE_MODEL_SERVER_GRPC_PORT="0",
        FORGE_MODEL_SERVER_HOST="0.0.0.0",
        FORGE_MODEL_SERVER_MODELS_DIR=posixpath.dirname(spec.model_dir.rstrip("/")),
        FORGE_MODEL_SERVER_AUTH_TOKEN=spec.replica_token,
        FORGE_MODEL_SERVER_KAFKA_ENABLED="false",
        # Loaded before it answers, as vLLM does: a replica that answers its probe can serve.
        FORGE_MODEL_SERVER_PRELOAD=json.dumps([posixpath.basename(spec.model_dir.rstrip("/"))]),
    )
    return ReplicaCommand([spec.forge_python, "-m", "forge_model_server"], env)


@dataclass
class Replica:
    """One replica as the workflow tracks it."""

    job_id: str
    state: str = "pending"
    """``pending``, ``ready`` (in the gateway's pool), ``draining`` or ``failed``."""
    endpoint: str = ""
    node: str = ""
    running_since: float = 0.0
    """Workflow time it was first seen running (0: not yet); bounds the wait for its health."""
    silent_since: float = 0.0
    """Workflow time a ready replica first missed a probe in the current run of misses (0: it
    answered the last one); it leaves the pool once that lasts ``UNANSWERED_S``."""


@dataclass
class DeploymentStatus:
    """What the ``deployment`` query answers."""

    spec: DeploymentInput
    desired_replicas: int
    state: str
    message: str
    replicas: list[Replica]

    @property
    def ready_replicas(self) -> int:
        return sum(1 for r in self.replicas if r.state == "ready")
