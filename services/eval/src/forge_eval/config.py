"""Eval settings (env prefix ``FORGE_EVAL_``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator

from forge_kit.settings import ServiceSettings, interpreter_path, service_config
from forge_kit.vllm import LaunchError, parse_engine_flags


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
    """Bearer token issued to eval by the gateway (a tenant key); sent only to
    ``inference_gateway_url``."""

    model_endpoints: dict[str, SecretStr] = Field(default_factory=dict)
    """Further model endpoints runs may query, JSON ``{"http://host:port": "<token or empty>"}``:
    each token is sent only to its own URL. A non-admin's RunSuite must name a registered endpoint
    (these, the gateway); an admin's may name another, which then gets no credential."""

    benchmarks_dir: str = "benchmarks"
    """Root of the benchmark data (one folder per suite, MANIFEST.tsv); absolute, or inside FORGE_DATA_DIR."""

    corpora_dir: str = "corpora"
    """Root of the text corpora perplexity tasks read; absolute, or inside FORGE_DATA_DIR."""

    response_cache_path: str = "var/cache/eval/responses.sqlite"
    """SQLite response cache keyed by request and model identity; empty disables it."""

    request_batch_size: int = Field(default=16, ge=1, le=256)
    """Prompts per /v1/completions request (1 for endpoints that take one prompt per request)."""

    request_concurrency: int = Field(default=64, ge=1, le=256)
    """Requests in flight to the model endpoint per run: enough to fill a model_server's batch
    (its MAX_NUM_SEQS, 64); it queues the rest and answers 429 (retried) past its queue."""

    run_concurrency: int = Field(default=1, ge=1, le=64)
    """Eval runs executed at the same time by this process."""

    request_timeout_s: float = Field(default=60.0, gt=0)
    """Timeout of one request to the model endpoint."""

    max_page_size: int = Field(default=500, ge=1)
    """Upper bound on page_size in list calls."""

    admin_tokens: dict[str, SecretStr] = Field(default_factory=dict)
    """Named admin tokens besides the service token, JSON ``{"alice": "<token>"}``: recorded by name
    in the audit trail; an admin may force a promotion past a failing gate."""

    user_tokens: dict[str, SecretStr] = Field(default_factory=dict)
    """Named non-admin tokens, JSON ``{"ci": "<token>"}``: may run, compare, register and promote
    through the gate, but not force."""

    model_server_command: list[str] = Field(default_factory=list)
    """Command starting a model server for ``serve_model`` runs (JSON list); empty: this Python's
    ``-m forge_model_server``."""

    model_server_start_timeout_s: float = Field(default=180.0, gt=0)
    """How long a model server started for a run may take to serve its checkpoint."""

    model_server_engine: Literal["forge", "vllm"] = "forge"
    """The engine of ``serve_model`` runs: Forge's model server (``model_server_command``) or
    vLLM's OpenAI-compatible server from vLLM's own environment (``vllm_python``)."""

    vllm_python: str = Field(default="", max_length=1024)
    """vLLM's interpreter for ``serve_model`` runs; empty: ``$FORGE_VLLM_PYTHON``, else the
    checkout's ``.venv-vllm``. A relative path is taken from eval's working directory."""

    vllm_engine_args: list[str] = Field(default_factory=list, max_length=64)
    """vLLM engine flags of ``serve_model`` runs, JSON list (``["--max-num-seqs", "8"]``), the
    flags ``forge serve deploy --arg`` takes; checked at start."""

    @field_validator("vllm_python")
    @classmethod
    def _absolute_interpreter(cls, value: str) -> str:
        return interpreter_path(value)

    @field_validator("vllm_engine_args")
    @classmethod
    def _known_engine_flags(cls, value: list[str]) -> list[str]:
        try:
            parse_engine_flags(value)
        except LaunchError as exc:
            raise ValueError(str(exc)) from None
        return value
