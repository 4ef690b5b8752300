"""Eval settings (env prefix ``FORGE_EVAL_``)."""

from __future__ import annotations

from pydantic import Field, SecretStr

from forge_kit.settings import ServiceSettings, service_config


class EvalSettings(ServiceSettings):
    """Settings of the eval process."""

    model_config = service_config("eval")

    grpc_port: int = Field(default=50057, ge=0, le=65535)
    """gRPC port of the EvalService."""

    http_port: int = Field(default=8057, ge=0, le=65535)
    """HTTP port for health and metrics."""

    inference_gateway_url: str = "http://127.0.0.1:8080"
    """OpenAI-compatible base URL runs query when RunSuite names no endpoint."""

    inference_gateway_token: SecretStr = SecretStr("")
    """Bearer token sent to the model endpoint."""

    benchmarks_dir: str = "../shared/data/benchmarks"
    """Root of the benchmark data (one folder per suite, MANIFEST.tsv); relative to the repository."""

    run_concurrency: int = Field(default=1, ge=1, le=64)
    """Eval runs executed at the same time by this process."""

    request_timeout_s: float = Field(default=60.0, gt=0)
    """Timeout of one request to the model endpoint."""

    max_page_size: int = Field(default=500, ge=1)
    """Upper bound on page_size in list calls."""
