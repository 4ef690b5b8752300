"""The model server's Prometheus metrics, under vLLM's names, so dashboards and the gateway's
router read Forge replicas and vLLM alike."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

NUM_REQUESTS_RUNNING = Gauge(
    "vllm:num_requests_running", "Number of requests in model execution batches.", ["model_name"]
)
NUM_REQUESTS_WAITING = Gauge(
    "vllm:num_requests_waiting", "Number of requests waiting to be processed.", ["model_name"]
)
REQUEST_SUCCESS = Counter(
    "vllm:request_success", "Count of successfully processed requests.", ["model_name", "finished_reason"]
)
PROMPT_TOKENS = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", ["model_name"])
GENERATION_TOKENS = Counter(
    "vllm:generation_tokens", "Number of generation tokens processed.", ["model_name"]
)
E2E_LATENCY = Histogram(
    "vllm:e2e_request_latency_seconds",
    "Histogram of end to end request latency in seconds.",
    ["model_name"],
    buckets=(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
)

TIME_TO_FIRST_TOKEN = Histogram(
    "vllm:time_to_first_token_seconds",
    "Histogram of time to first token in seconds.",
    ["model_name"],
    buckets=(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0),
)
INTER_TOKEN_LATENCY = Histogram(
    "vllm:inter_token_latency_seconds",
    "Histogram of inter-token latency in seconds.",
    ["model_name"],
    buckets=(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5),
)
KV_CACHE_USAGE = Gauge(
    "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", ["model_name"]
)
NUM_PREEMPTIONS = Counter(
    "vllm:num_preemptions", "Cumulative number of preemption from the engine.", ["model_name"]
)
PREFIX_CACHE_QUERIES = Counter(
    "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", ["model_name"]
)
PREFIX_CACHE_HITS = Counter(
    "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", ["model_name"]
)
