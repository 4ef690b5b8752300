"""Inference gateway settings (env prefix ``FORGE_INFERENCE_GATEWAY_``)."""

from __future__ import annotations

from pydantic import Field, SecretStr

from forge_kit.settings import ServiceSettings, service_config


class InferenceGatewaySettings(ServiceSettings):
    """Settings of the inference gateway process."""

    model_config = service_config("inference_gateway")

    grpc_port: int = Field(default=50053, ge=0, le=65535)
    """gRPC port of the public InferenceService."""

    http_port: int = Field(default=8080, ge=0, le=65535)
    """HTTP port of the public OpenAI-compatible API, the admin API, probes and metrics."""

    model_server_url: str = "http://127.0.0.1:8000"
    """Base URL of the upstream model server (Forge ``model_server`` or ``vllm serve``)."""

    model_server_token: SecretStr = SecretStr("forge-dev-token")
    """Bearer token the gateway presents to the model server (vLLM's ``--api-key``)."""

    bootstrap_api_key: SecretStr = SecretStr("forge-dev-key")
    """API key of the ``default`` tenant, created or re-keyed at start-up; empty: no bootstrap tenant."""

    default_rpm_limit: int = Field(default=600, ge=1)
    """Requests per minute allowed to the bootstrap tenant and to tenants created without a limit."""

    request_timeout_s: float = Field(default=60.0, gt=0)
    """Deadline of one inference request, end to end; what is left of it is passed upstream."""
