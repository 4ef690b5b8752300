"""Model server settings (env prefix ``FORGE_MODEL_SERVER_``)."""

from __future__ import annotations

from pydantic import Field

from forge_kit.settings import ServiceSettings, service_config


class ModelServerSettings(ServiceSettings):
    """Settings of the model server process."""

    model_config = service_config("model_server")

    grpc_port: int = Field(default=50054, ge=0, le=65535)
    """gRPC port of the InferenceService (Generate, ListModels)."""

    http_port: int = Field(default=8000, ge=0, le=65535)
    """HTTP port of the OpenAI-compatible API, probes and metrics (vLLM's default port)."""

    models_dir: str = "var/objects/models"
    """fsspec URL or local path of the model directory: one Hugging Face-format folder per model."""
