"""Model server settings (env prefix ``FORGE_MODEL_SERVER_``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from forge_kit.images import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS
from forge_kit.limits import OPENAI_MAX_BODY_BYTES
from forge_kit.settings import ServiceSettings, service_config


class ModelServerSettings(ServiceSettings):
    """Settings of the model server process."""

    model_config = service_config("model_server")

    grpc_port: int = Field(default=50054, ge=0, le=65535)
    """gRPC port of the InferenceService (Generate, ListModels)."""

    http_port: int = Field(default=8000, ge=0, le=65535)
    """HTTP port of the OpenAI-compatible API, probes and metrics (vLLM's default port)."""

    http_max_body_bytes: int = Field(default=2 * OPENAI_MAX_BODY_BYTES, ge=1024)
    """Largest HTTP request body accepted (twice the gateway's, which re-encodes what it relays);
    413 in the OpenAI format beyond."""

    models_dir: str = "var/objects/models"
    """fsspec URL or local path of the model directory: one Hugging Face-format folder per model."""

    block_size: int = Field(default=16, ge=1, le=1024)
    """Token slots per KV-cache block (vLLM's ``--block-size``)."""

    num_kv_blocks: int = Field(default=512, ge=1)
    """Blocks in each model's KV-cache pool; the pool holds ``num_kv_blocks * block_size`` tokens."""

    max_num_seqs: int = Field(default=64, ge=1)
    """Most sequences in one batch (vLLM's ``--max-num-seqs``)."""

    max_num_batched_tokens: int = Field(default=512, ge=1)
    """Token budget of one engine step; longer prompts are prefilled in chunks of it."""

    max_waiting_requests: int = Field(default=256, ge=0)
    """Admitted requests that may wait for a batch slot; beyond it requests get 429 / RESOURCE_EXHAUSTED."""

    enable_prefix_caching: bool = True
    """Reuse the KV blocks of prompt prefixes already computed (vLLM's ``--enable-prefix-caching``)."""

    drain_timeout_s: float = Field(default=30.0, ge=0)
    """On SIGTERM, how long admitted requests may run to completion before they are cancelled."""

    torch_threads: int = Field(default=1, ge=0)
    """Intra-op threads of the forward pass; 0 keeps torch's default (one per core). One by
    default: after each multi-threaded op torch's OpenMP workers spin for a while, taking cores
    from the step's serial Python and from the event loop that streams the answers, and a worker
    that another process preempts stalls every op (on 2 shared cores two threads made the engine
    several times slower, see ``load/inference/RESULTS.md``). Give a replica with cores of its
    own as many threads."""

    image_max_bytes: int = Field(default=MAX_IMAGE_BYTES, ge=1024)
    """Largest encoded image (a decoded data: URI or a download) one ``image_url`` part may carry."""

    image_max_pixels: int = Field(default=MAX_IMAGE_PIXELS, ge=1)
    """Largest image (width x height), checked on its header before any pixel is decoded."""

    image_max_per_request: int = Field(default=8, ge=0)
    """Most images one chat request may carry."""

    image_url_fetch: bool = False
    """Fetch http(s) ``image_url``s (public addresses only, no redirect to another host, no
    credentials); off: only data: URIs are taken."""

    image_url_timeout_s: float = Field(default=10.0, gt=0, le=120)
    """Time limit of one image download."""

    image_url_allowed_networks: list[str] = Field(default_factory=list)
    """CIDRs that image URLs may reach although not public (an internal image store); empty by default."""

    decode_attention: Literal["auto", "native", "torch"] = "auto"
    """Decode attention over the paged KV cache: ``native`` is the one-pass C++ kernel (built on first
    use with the compiler found here; loading a model fails, naming why, where it cannot be built), ``torch`` batched
    matmuls, ``auto`` the kernel where it builds and torch elsewhere (with a warning)."""

    preload: list[str] = Field(default_factory=list, max_length=16)
    """Models (names of the model directory's folders) loaded at start-up, before the servers
    answer, as vLLM loads its model: a deployment's replica sets its model here, so the replica
    is ready to serve once it answers. Empty: each model loads on its first request."""
