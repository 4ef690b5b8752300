"""Inference gateway settings (env prefix ``FORGE_INFERENCE_GATEWAY_``)."""

from __future__ import annotations

from pydantic import Field, SecretStr, model_validator

from forge_inference_gateway.admission import AdmissionPolicy
from forge_inference_gateway.autoscaling import AutoscalePolicy
from forge_inference_gateway.routing import RoutingPolicy
from forge_kit.settings import ServiceSettings, service_config


class InferenceGatewaySettings(ServiceSettings):
    """Settings of the inference gateway process."""

    model_config = service_config("inference_gateway")

    grpc_port: int = Field(default=50053, ge=0, le=65535)
    """gRPC port of the public InferenceService."""

    http_port: int = Field(default=8080, ge=0, le=65535)
    """HTTP port of the public OpenAI-compatible API, the admin API, probes and metrics."""

    model_server_url: str = "http://127.0.0.1:8000"
    """Base URLs of the model-server replicas (Forge ``model_server`` or ``vllm serve``), comma
    separated; more can be added and removed at run time through the admin API."""

    model_server_token: SecretStr = SecretStr("forge-dev-token")
    """Bearer token the gateway presents to the model servers (vLLM's ``--api-key``)."""

    upstream_priority: bool = True
    """Send each request's admission level as vLLM's ``priority`` (0 interactive, 1 batch); turn off
    for a vLLM started without ``--scheduling-policy priority``, which refuses the field."""

    bootstrap_api_key: SecretStr = SecretStr("forge-dev-key")
    """API key of the ``default`` tenant, created or re-keyed at start-up; empty: no bootstrap tenant."""

    default_rpm_limit: int = Field(default=600, ge=1)
    """Requests per minute allowed to the bootstrap tenant and to tenants created without a limit."""

    request_timeout_s: float = Field(default=60.0, gt=0)
    """Deadline of one inference request, end to end, queueing included; what is left of it is
    passed upstream."""

    metrics_interval_s: float = Field(default=0.5, gt=0)
    """How often every replica's ``/metrics`` is scraped (queue depth, KV-cache use)."""

    scrape_timeout_s: float = Field(default=1.0, gt=0)
    """Timeout of one scrape; a replica that does not answer in time counts a failure."""

    models_refresh_s: float = Field(default=10.0, gt=0)
    """How often each replica's ``/v1/models`` is read to learn what it serves."""

    replica_sync_s: float = Field(default=5.0, gt=0)
    """How often the replicas added through the admin API are re-read from the database."""

    max_inflight_per_replica: int = Field(default=64, ge=1)
    """Requests one replica may run at once (about its ``--max-num-seqs``); beyond it requests queue
    at the gateway, in priority order."""

    interactive_reserve: float = Field(default=0.25, ge=0, lt=1)
    """Share of each replica's slots that batch requests may not take."""

    kv_high: float = Field(default=0.95, gt=0, le=1)
    """KV-cache use above which a replica takes no more batch requests."""

    kv_weight: float = Field(default=1.0, ge=0)
    """Weight of KV-cache use against load (both 0-1) in a replica's routing score."""

    affinity_slack: float = Field(default=0.25, ge=0)
    """How much worse than the least-loaded replica's score the prefix-affine replica's may be and
    still win (0.25: a quarter of ``max_inflight_per_replica`` more requests)."""

    affinity_block_chars: int = Field(default=64, ge=1)
    """Prompt characters per prefix block in the affinity index."""

    affinity_max_blocks: int = Field(default=32, ge=0)
    """Leading blocks of a prompt the affinity index looks at; 0 turns prefix affinity off."""

    eject_after_failures: int = Field(default=2, ge=1)
    """Failures in a row (scrapes or connections) after which a replica is taken out of routing."""

    eject_base_s: float = Field(default=2.0, gt=0)
    """First back-off of an ejected replica before it is probed again; doubles on each failed probe."""

    eject_max_s: float = Field(default=60.0, gt=0)
    """Longest back-off of an ejected replica."""

    upstream_attempts: int = Field(default=2, ge=1)
    """Replicas tried for one request when a replica cannot be reached or is full (429/503)."""

    max_queue_per_model: int = Field(default=256, ge=0)
    """Requests that may wait for a slot per model; beyond it the lowest priority is shed (429)."""

    shed_retry_after_s: float = Field(default=2.0, gt=0)
    """``Retry-After`` of a request shed from a full queue."""

    response_cache_ttl_s: float = Field(default=300.0, ge=0)
    """How long an answer to a deterministic request (temperature 0 or a seed) is replayed; 0 turns
    the response cache off."""

    response_cache_max_bytes: int = Field(default=1 << 20, ge=0)
    """Largest answer the response cache stores."""

    alias_cache_ttl_s: float = Field(default=1.0, ge=0)
    """How long a resolved alias is reused before the database is read again (changes made by this
    process apply at once)."""

    tenant_cache_ttl_s: float = Field(default=5.0, ge=0)
    """How long an authenticated API key is reused before the database is read again."""

    autoscale_target_per_replica: float = Field(default=16.0, gt=0)
    """Requests (queued + running) one replica should carry; the load term of desired replicas."""

    autoscale_ttft_slo_s: float = Field(default=2.0, gt=0)
    """Time-to-first-token SLO (p99); the latency term of desired replicas."""

    autoscale_min_replicas: int = Field(default=1, ge=0)
    """Fewest replicas the autoscaling signal asks for."""

    autoscale_max_replicas: int = Field(default=16, ge=1)
    """Most replicas the autoscaling signal asks for."""

    @model_validator(mode="after")
    def _ranges(self) -> InferenceGatewaySettings:
        if self.autoscale_min_replicas > self.autoscale_max_replicas:
            raise ValueError("autoscale_min_replicas must not exceed autoscale_max_replicas")
        if self.eject_base_s > self.eject_max_s:
            raise ValueError("eject_base_s must not exceed eject_max_s")
        if not self.replica_urls():
            raise ValueError("model_server_url: give at least one model-server URL")
        return self

    def replica_urls(self) -> list[str]:
        return [u.strip() for u in self.model_server_url.split(",") if u.strip()]

    def routing_policy(self) -> RoutingPolicy:
        return RoutingPolicy(
            max_inflight=self.max_inflight_per_replica,
            reserve=self.interactive_reserve,
            kv_high=self.kv_high,
            kv_weight=self.kv_weight,
            affinity_slack=self.affinity_slack,
            block_chars=self.affinity_block_chars,
            max_blocks=self.affinity_max_blocks,
            eject_after=self.eject_after_failures,
            eject_base_s=self.eject_base_s,
            eject_max_s=self.eject_max_s,
            scrape_timeout_s=self.scrape_timeout_s,
            models_refresh_s=self.models_refresh_s,
        )

    def admission_policy(self) -> AdmissionPolicy:
        return AdmissionPolicy(max_queue=self.max_queue_per_model, retry_after_s=self.shed_retry_after_s)

    def autoscale_policy(self) -> AutoscalePolicy:
        return AutoscalePolicy(
            target_per_replica=self.autoscale_target_per_replica,
            ttft_slo_s=self.autoscale_ttft_slo_s,
            min_replicas=self.autoscale_min_replicas,
            max_replicas=self.autoscale_max_replicas,
        )
