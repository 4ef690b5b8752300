"""Orchestrator settings (env prefix ``FORGE_ORCHESTRATOR_``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from temporalio.service import TLSConfig

from forge_experiments.canary import federation_url
from forge_kit.settings import ServiceSettings, interpreter_path, service_config

NO_TOKEN = SecretStr("")


class OrchestratorSettings(ServiceSettings):
    """Settings of the orchestrator process (gRPC front door, Temporal worker, job-event consumer)."""

    model_config = service_config("orchestrator")

    grpc_port: int = Field(default=50059, ge=0, le=65535)
    """gRPC port of the OrchestratorService."""

    http_port: int = Field(default=8059, ge=0, le=65535)
    """HTTP port for health and metrics."""

    temporal_target: str = "127.0.0.1:7233"
    """host:port of the Temporal frontend."""

    temporal_namespace: str = "default"
    """Temporal namespace the workflows run in."""

    task_queue: str = "forge-orchestrator"
    """Temporal task queue this process's worker polls and new workflows are started on."""

    temporal_connect_timeout_s: float = Field(default=30.0, gt=0)
    """How long start-up keeps retrying to reach Temporal before giving up."""

    temporal_tls_ca_file: str = ""
    """PEM CA that signed the Temporal frontend's certificate; with the client certificate and
    key below, the connection uses mutual TLS (all three or none)."""

    temporal_tls_cert_file: str = ""
    """PEM client certificate this process presents to Temporal."""

    temporal_tls_key_file: str = ""
    """PEM private key of ``temporal_tls_cert_file``."""

    temporal_tls_server_name: str = ""
    """Name to verify in the frontend's certificate when it differs from the target's host."""

    consumer_group: str = "orchestrator"
    """Kafka consumer group of the job-event consumer."""

    catch_up_interval_s: float = Field(default=30.0, gt=0)
    """How often job events are also read from the scheduler's outbox (events the broker lost)."""

    release_suite: str = "tinyshakespeare_ppl"
    """Suite the eval-and-promote workflow runs for each published checkpoint: held-out perplexity
    on the pre-training corpus, which every model the platform trains can be scored on (a tiny
    Shakespeare model scores zero on GSM8K, so a regression there would go unseen)."""

    release_limit: int = Field(default=50, ge=0)
    """Examples of the release suite scored per model (0: all)."""

    release_tier: Literal["full", "smoke"] = "smoke"
    """Tier of the release runs. ``smoke`` (each task's stratified subset: 20 documents of
    ``tinyshakespeare_ppl``) keeps ``forge up``'s eval step around a minute on 2 CPU cores;
    ``full`` scores up to ``release_limit`` examples, for deployments with the compute for it."""

    mlflow_uri: str = ""
    """URL of the MLflow tracking server (``forge up`` runs one); empty: training runs are not
    tracked and the tracking consumer does not start."""

    mlflow_ui_uri: str = ""
    """Base URL of the MLflow UI in the run links this service hands out; empty: ``mlflow_uri``."""

    tracking_consumer_group: str = "orchestrator-tracking"
    """Kafka consumer group of the consumer that records training runs in MLflow."""

    code_version: str = ""
    """Code version logged with every tracked run; empty: the git commit of the checkout this
    process runs from, when it runs from one."""

    consumer_session_timeout_ms: int = Field(default=10_000, ge=1_000)
    """Kafka group session timeout: how long a dead consumer holds its partitions (and how long
    every group join waits on the local broker)."""

    scheduler_target: str = "127.0.0.1:50051"
    """host:port of the scheduler's gRPC server (activities submit and cancel jobs there)."""

    scheduler_token: SecretStr = NO_TOKEN
    """Bearer token the scheduler accepts."""

    trainer_agent_token: SecretStr = NO_TOKEN
    """Bearer token the trainer agents accept; set, the consumers also read each agent's outbox
    (node label ``forge.ai/event-log``) for the training metrics the broker lost."""

    eval_target: str = "127.0.0.1:50057"
    """host:port of the eval service's gRPC server (eval-and-promote workflows)."""

    eval_token: SecretStr = NO_TOKEN
    """Bearer token the eval service accepts."""

    gateway_metrics_urls: list[str] = Field(default_factory=list)
    """The inference gateway replicas' ``/metrics`` URLs (JSON list in the environment), summed
    by the guarded canary's analysis; empty: no gateway is watched and a canary sees no traffic
    (so it is never promoted by the default policy)."""

    gateway_metrics_prometheus_url: str = ""
    """A Prometheus server that scrapes every inference gateway replica (``http://host:9090``):
    the guarded canary then reads their counters, summed, from its federation endpoint
    (:func:`forge_experiments.canary.federation_url`), for gateways behind a Service that reaches
    one replica at a time (Kubernetes). Instead of ``gateway_metrics_urls``, not beside them."""

    canary_policy: str = ""
    """Canary policy family of eval-and-promote workflows whose input names none; empty: the
    model's name (``policies/canary/<name>.yaml``, else ``default.yaml``)."""

    canary_policy_dir: str = ""
    """Folder of the canary policy files (``<family>.yaml``); empty: ``policies/canary`` of the
    checkout."""

    preference_feedback_target: str = "127.0.0.1:50058"
    """host:port of the preference-feedback gRPC server (RLHF workflows)."""

    preference_feedback_token: SecretStr = NO_TOKEN
    """Bearer token the preference-feedback service accepts."""

    inference_gateway_target: str = "127.0.0.1:50053"
    """host:port of the inference gateway's gRPC server (the RLHF round samples the policy there)."""

    inference_gateway_token: SecretStr = NO_TOKEN
    """Bearer token the inference gateway accepts."""

    inference_gateway_url: str = ""
    """HTTP address of the inference gateway (its admin API: the production prompt pool and shadow
    pairs of online RLHF rounds, with ``inference_gateway_token``); empty: ``FORGE_RLHF_GATEWAY_URL``."""

    deploy_forge_python: str = Field(default="python", min_length=1, max_length=1024)
    """Interpreter of Forge's environment on the nodes: the ``forge`` engine's replicas run
    ``<it> -m forge_model_server``."""

    deploy_vllm_python: str = Field(default=".venv-vllm/bin/python", min_length=1, max_length=1024)
    """Interpreter of vLLM's own environment on the nodes (the ``vllm`` engine's replicas). A
    relative path (here and in ``deploy_forge_python``) is taken from the orchestrator's working
    directory: replicas start in their own run folders, where it would name nothing."""

    deploy_poll_s: float = Field(default=2.0, ge=0.1, le=60)
    """Reconcile period of deployment workflows."""

    deploy_scale_down_delay_s: float = Field(default=60.0, ge=0, le=86400)
    """How long an autoscaled deployment's gateway signal must stay lower before replicas are drained."""

    promote_deploy: bool = False
    """Promotions roll replicas: eval-and-promote deploys the candidate (``promote_deploy_*``) and
    waits for its replicas before the canary split, and undeploys the version that lost. The
    ``synthetic`` workflow's student is deployed the same way while it is sampled through the gateway."""

    promote_deploy_engine: Literal["forge", "vllm"] = "forge"
    """Engine of a promoted version's deployment."""

    promote_deploy_team: str = Field(default="serving", min_length=1, max_length=52)
    """Team whose inference pool a promoted version's replicas are placed in."""

    promote_deploy_gpu_type: str = Field(default="", max_length=64)
    """GPU type each replica asks for (required with ``promote_deploy``)."""

    promote_deploy_gpu_count: int = Field(default=1, ge=1, le=64)
    """GPUs per replica."""

    promote_deploy_replicas: int = Field(default=1, ge=1, le=64)
    """Replicas of a promoted version (its deployment's ``min_replicas``)."""

    promote_deploy_max_replicas: int = Field(default=0, ge=0, le=64)
    """Most replicas of a promoted version: above ``promote_deploy_replicas``, its deployment
    scales on the gateway's ``vllm:num_requests_waiting`` between the two; 0: as many as
    ``promote_deploy_replicas`` (a fixed count)."""

    promote_deploy_engine_args: list[str] = Field(default_factory=list, max_length=64)
    """Engine arguments of each replica (as ``forge serve deploy --arg``)."""

    promote_deploy_dir: str = ""
    """Where a ``forge``-engine version's model folder is laid out (nodes must see the same
    path); empty: ``<data_dir>/promoted``."""

    promote_deploy_ready_timeout_s: float = Field(default=900.0, gt=0, le=86400)
    """How long a promotion waits for the candidate's replicas before it is blocked."""

    retriever_target: str = "127.0.0.1:50055"
    """host:port of the retriever's gRPC server (wired by the platform table; no workflow calls it
    yet)."""

    retriever_token: SecretStr = NO_TOKEN
    """Bearer token the retriever accepts."""

    @field_validator("deploy_forge_python", "deploy_vllm_python")
    @classmethod
    def _absolute_interpreter(cls, value: str) -> str:
        return interpreter_path(value)

    @model_validator(mode="after")
    def _promote_deploy_placeable(self) -> OrchestratorSettings:
        if self.promote_deploy and not self.promote_deploy_gpu_type:
            raise ValueError("promote_deploy needs promote_deploy_gpu_type (the GPU type replicas ask for)")
        if (
            self.promote_deploy_max_replicas
            and self.promote_deploy_max_replicas < self.promote_deploy_replicas
        ):
            raise ValueError("promote_deploy_max_replicas must be 0 or at least promote_deploy_replicas")
        return self

    @model_validator(mode="after")
    def _one_canary_metrics_source(self) -> OrchestratorSettings:
        url = self.gateway_metrics_prometheus_url
        if url and self.gateway_metrics_urls:
            raise ValueError(
                "gateway_metrics_prometheus_url and gateway_metrics_urls both count the gateways' "
                "traffic (twice, summed): set one"
            )
        if url and urlsplit(url).scheme not in ("http", "https"):
            raise ValueError(f"gateway_metrics_prometheus_url: {url!r} is not an http(s) URL")
        return self

    def canary_metrics_urls(self) -> list[str]:
        """Where the guarded canary reads the gateways' counters (each address's summed)."""
        if self.gateway_metrics_prometheus_url:
            return [federation_url(self.gateway_metrics_prometheus_url)]
        return list(self.gateway_metrics_urls)

    @model_validator(mode="after")
    def _temporal_tls_all_or_nothing(self) -> OrchestratorSettings:
        files = {
            "temporal_tls_ca_file": self.temporal_tls_ca_file,
            "temporal_tls_cert_file": self.temporal_tls_cert_file,
            "temporal_tls_key_file": self.temporal_tls_key_file,
        }
        if any(files.values()) and not all(files.values()):
            missing = ", ".join(name for name, value in files.items() if not value)
            raise ValueError(f"Temporal mutual TLS needs all of {', '.join(files)}; missing: {missing}")
        for name, value in files.items():
            if value and not os.path.isfile(value):
                raise ValueError(f"{name}: no such file: {value}")
        return self

    def temporal_tls(self) -> TLSConfig | None:
        """The Temporal client's mutual-TLS configuration, or None for plaintext (local dev server)."""
        if not self.temporal_tls_ca_file:
            return None
        return TLSConfig(
            server_root_ca_cert=Path(self.temporal_tls_ca_file).read_bytes(),
            client_cert=Path(self.temporal_tls_cert_file).read_bytes(),
            client_private_key=Path(self.temporal_tls_key_file).read_bytes(),
            domain=self.temporal_tls_server_name or None,
        )
