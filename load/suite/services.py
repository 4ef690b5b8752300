"""Start the real service processes a scenario drives, each in its own work folder, on free ports,
with Kafka off (the scenarios measure the request path; the broker has its own fault tests)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from forge_kit.testing.processes import ServiceProcess

TOKEN = "load-suite-token"
"""The service token every started process accepts (admin rights in each service)."""
TENANT_KEY = "load-suite-tenant-key"
"""The gateway's bootstrap tenant API key."""
REPO = Path(__file__).resolve().parents[2]


def service(module: str, prefix: str, work: Path, env: dict[str, str] | None = None) -> ServiceProcess:
    """``python -m <module>`` with ports 0, the suite's token, Kafka off and data under ``work``."""
    folder = work / module
    folder.mkdir(parents=True, exist_ok=True)
    base = {
        f"{prefix}_GRPC_PORT": "0",
        f"{prefix}_HTTP_PORT": "0",
        f"{prefix}_AUTH_TOKEN": TOKEN,
        f"{prefix}_DATA_DIR": str(folder),
        f"{prefix}_KAFKA_ENABLED": "false",
        f"{prefix}_LOG_LEVEL": "WARNING",
    }
    return ServiceProcess(
        module, env={**base, **(env or {})}, cwd=str(folder), log_path=str(folder / "service.log")
    ).start(180)


def scheduler(work: Path) -> ServiceProcess:
    return service("forge_scheduler", "FORGE_SCHEDULER", work)


def retriever(work: Path) -> ServiceProcess:
    return service("forge_retriever", "FORGE_RETRIEVER", work)


def reranker(work: Path) -> ServiceProcess:
    return service("forge_reranker", "FORGE_RERANKER", work)


def _bench_gateway() -> ModuleType:
    """``load/inference/bench_gateway.py``, for its random Llama with a trained BPE tokenizer."""
    spec = importlib.util.spec_from_file_location("bench_gateway", REPO / "load/inference/bench_gateway.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def inference(work: Path, *, hidden: int = 64, layers: int = 2) -> tuple[ServiceProcess, ServiceProcess]:
    """A model server serving a random Llama named ``tiny`` and a gateway in front of it."""
    models = work / "models"
    if not (models / "tiny" / "config.json").is_file():
        _bench_gateway().random_model(models / "tiny", seed=0, hidden=hidden, layers=layers)
    server = service(
        "forge_model_server",
        "FORGE_MODEL_SERVER",
        work,
        {
            "FORGE_MODEL_SERVER_MODELS_DIR": str(models),
            "FORGE_MODEL_SERVER_TORCH_THREADS": "1",
            "FORGE_MODEL_SERVER_MAX_WAITING_REQUESTS": "4096",
        },
    )
    try:
        gateway = service(
            "forge_inference_gateway",
            "FORGE_INFERENCE_GATEWAY",
            work,
            {
                "FORGE_INFERENCE_GATEWAY_MODEL_SERVER_URL": server.http_url,
                "FORGE_INFERENCE_GATEWAY_MODEL_SERVER_TOKEN": TOKEN,
                "FORGE_INFERENCE_GATEWAY_BOOTSTRAP_API_KEY": TENANT_KEY,
                "FORGE_INFERENCE_GATEWAY_DEFAULT_RPM_LIMIT": "100000000",
                "FORGE_INFERENCE_GATEWAY_RESPONSE_CACHE_TTL_S": "0",
            },
        )
    except BaseException:
        server.stop()
        raise
    return server, gateway
