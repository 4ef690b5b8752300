"""The gateway's benchmarks and load tools, apart from the request path (nothing there imports
them): the ``forge.bench`` entry points ``canary`` (:mod:`.canary`, the guarded canary's analysis
against real replicas behind :mod:`.fault_replica` fronts) and ``serving`` (:mod:`.serving`, the
gateway in front of vLLM or model servers), and ``forge load inference`` (:mod:`.load_cli`), all
measuring with one load generator (:mod:`.loadgen`, vLLM's ``bench serve`` methodology)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from forge_kit.testing import ServiceProcess


def start_model_server(
    models: Path, work: Path, token: str, *, log_name: str, settings: Mapping[str, str], timeout_s: float
) -> ServiceProcess:
    """A ``forge_model_server`` process serving the folders under ``models`` on free ports, with
    no broker; ``settings`` are more of its ``FORGE_MODEL_SERVER_*`` settings (names without the
    prefix)."""
    return ServiceProcess(
        "forge_model_server",
        env={
            "FORGE_MODEL_SERVER_GRPC_PORT": "0",
            "FORGE_MODEL_SERVER_HTTP_PORT": "0",
            "FORGE_MODEL_SERVER_AUTH_TOKEN": token,
            "FORGE_MODEL_SERVER_MODELS_DIR": str(models),
            "FORGE_MODEL_SERVER_KAFKA_ENABLED": "false",
            "FORGE_MODEL_SERVER_LOG_LEVEL": "WARNING",
            **{f"FORGE_MODEL_SERVER_{k}": v for k, v in settings.items()},
        },
        cwd=str(work),
        log_path=str(work / log_name),
    ).start(timeout_s)


def start_gateway(
    upstreams: list[str],
    work: Path,
    token: str,
    api_key: str,
    *,
    settings: Mapping[str, str] = {},
    timeout_s: float,
) -> ServiceProcess:
    """A ``forge_inference_gateway`` process in front of ``upstreams`` (sent ``token``) on free
    ports, with no broker, no rate limit and no response cache, its tenant keyed ``api_key``;
    ``settings`` are more of its ``FORGE_INFERENCE_GATEWAY_*`` settings (names without the prefix)."""
    return ServiceProcess(
        "forge_inference_gateway",
        env={
            "FORGE_INFERENCE_GATEWAY_GRPC_PORT": "0",
            "FORGE_INFERENCE_GATEWAY_HTTP_PORT": "0",
            "FORGE_INFERENCE_GATEWAY_AUTH_TOKEN": token,
            "FORGE_INFERENCE_GATEWAY_DATA_DIR": str(work / "gateway"),
            "FORGE_INFERENCE_GATEWAY_KAFKA_ENABLED": "false",
            "FORGE_INFERENCE_GATEWAY_MODEL_SERVER_URL": ",".join(upstreams),
            "FORGE_INFERENCE_GATEWAY_MODEL_SERVER_TOKEN": token,
            "FORGE_INFERENCE_GATEWAY_BOOTSTRAP_API_KEY": api_key,
            "FORGE_INFERENCE_GATEWAY_DEFAULT_RPM_LIMIT": "100000000",
            "FORGE_INFERENCE_GATEWAY_RESPONSE_CACHE_TTL_S": "0",
            "FORGE_INFERENCE_GATEWAY_LOG_LEVEL": "WARNING",
            **{f"FORGE_INFERENCE_GATEWAY_{k}": v for k, v in settings.items()},
        },
        cwd=str(work),
        log_path=str(work / "gateway.log"),
    ).start(timeout_s)
