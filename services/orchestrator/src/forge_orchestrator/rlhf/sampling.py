"""The online RLHF round's collection activity: draw prompts from the prompt pool, sample the
current policy on each through the inference gateway, queue the pairs for raters.

1. **Prompt pool**: prompts of a dataset (HH-RLHF lines under the data folder: the transcript
   before the last assistant turn), drawn by a seed of the round, plus production prompts that
   tenants allowed for training (the gateway's ``GET /admin/v1/training-prompts``; the gateway
   records prompts only for tenants that opted in).
2. **Samples**: two responses per prompt from the current policy through the gateway's gRPC
   ``Generate`` (the same path as every product request, at batch priority), one at each of two
   temperatures, with seeds fixed by the round so a retried activity asks for the same samples.
   A prompt whose two responses are equal or empty, or that the gateway refuses (longer than
   the model's context), gives no comparison (counted by reason).
3. **Queue**: ``AddComparisons`` to the feedback service under the round's batch, origin
   ``policy``; idempotent per (batch, prompt index), so a retry queues nothing twice. Raters get
   them with the existing overlap, leases and rater-quality controls; seed items with gold
   answers stay in the same queue.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
from forge.feedback.v1 import feedback_pb2, feedback_pb2_grpc
from forge.inference.v1 import inference_pb2, inference_pb2_grpc
from temporalio import activity
from temporalio.exceptions import ApplicationError

from forge_kit.grpckit import make_channel
from forge_kit.modelref import label
from forge_kit.paths import resolve_data_path
from forge_orchestrator.activities import failed
from forge_orchestrator.rlhf.shadow import ShadowPairs

ASSISTANT = "\n\nAssistant:"
MAX_PROMPT_CHARS = 4000
SCAN_LINES = 5000
"""Dataset lines read to draw from (the pool's dataset part is a prefix of the file)."""
CONCURRENCY = 4


@dataclass
class CollectInput:
    batch: str
    model: str
    """The current policy as the gateway serves it."""
    seed: int
    dataset: str
    dataset_prompts: int
    production_prompts: int
    temperatures: list[float] = field(default_factory=lambda: [0.7, 1.3])
    max_tokens: int = 32
    max_prompt_chars: int = 2000
    """Longer prompts of either part of the pool are not drawn."""


@dataclass
class CollectResult:
    dataset_prompts: int
    production_prompts: int
    queued: int
    """Comparisons queued by this call or an earlier try of it."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Prompts that gave no comparison, by reason."""
    served_by: str = ""
    """The model version the gateway answered with."""


def dataset_prompts(path: Path, count: int, seed: int, max_chars: int = MAX_PROMPT_CHARS) -> list[str]:
    """``count`` distinct prompts of the first :data:`SCAN_LINES` HH-RLHF lines of ``path``,
    drawn by ``seed``; unreadable lines and prompts over ``max_chars`` are skipped."""
    if count == 0:
        return []
    opener = gzip.open if path.name.endswith(".gz") else open
    found: dict[str, None] = {}
    with opener(path, "rt", encoding="utf-8") as lines:  # type: ignore[operator]
        for number, line in enumerate(lines):
            if number >= SCAN_LINES:
                break
            try:
                transcript = str(json.loads(line)["chosen"])
            except (ValueError, KeyError, TypeError):
                continue
            head, sep, _ = transcript.rpartition(ASSISTANT)
            if sep and head.strip() and len(head) + len(ASSISTANT) <= min(max_chars, MAX_PROMPT_CHARS):
                found[head + ASSISTANT] = None
    pool = list(found)
    return random.Random(seed).sample(pool, min(count, len(pool)))


class RlhfSampler:
    """The collection activity; one per worker, channels opened on first use."""

    def __init__(
        self,
        gateway_target: str,
        gateway_url: str,
        gateway_token: str,
        feedback_target: str,
        feedback_token: str,
        *,
        rpc_timeout_s: float = 120.0,
    ) -> None:
        self._gateway_target = gateway_target
        self._gateway_url = gateway_url.rstrip("/")
        self._gateway_token = gateway_token
        self._feedback_target = feedback_target
        self._feedback_token = feedback_token
        self._rpc_timeout_s = rpc_timeout_s
        self.shadows = ShadowPairs(gateway_url, gateway_token, feedback_target, feedback_token)
        """The shadow-pairs activity, on the same gateway and feedback service."""

    async def _production(self, count: int) -> list[str]:
        if count == 0 or not self._gateway_url:
            return []
        headers = {"Authorization": f"Bearer {self._gateway_token}"}
        async with httpx.AsyncClient(base_url=self._gateway_url, headers=headers, timeout=30) as http:
            reply = await http.get("/admin/v1/training-prompts", params={"limit": min(count, 1000)})
        if reply.status_code != 200:
            raise ApplicationError(
                f"the gateway's prompt pool answered HTTP {reply.status_code}: {reply.text[:300]}",
                type="PromptPoolUnavailable",
            )
        rows = reply.json().get("prompts", [])
        return [str(r["prompt"]) for r in rows if isinstance(r, dict) and isinstance(r.get("prompt"), str)]

    async def _sample(
        self,
        stub: inference_pb2_grpc.InferenceServiceAsyncStub,
        params: CollectInput,
        prompt: str,
        t: float,
        seed: int,
    ) -> tuple[str, str] | None:
        """The policy's response and the version that gave it; None when the gateway refuses the
        prompt itself (INVALID_ARGUMENT: e.g. longer than the model's context)."""
        request = inference_pb2.GenerateRequest(
            model=params.model,
            prompt=prompt,
            max_tokens=params.max_tokens,
            temperature=t,
            seed=seed,
            priority=inference_pb2.PRIORITY_LOW,
            request_id=f"{params.batch}/{seed}"[:128],
        )
        pieces: list[str] = []
        served = ""
        try:
            async for chunk in stub.Generate(request, timeout=self._rpc_timeout_s):
                pieces.append(chunk.text_delta)
                if chunk.HasField("model") and chunk.model.name:
                    served = label(chunk.model.name, chunk.model.version)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                return None
            raise failed("Generate", exc) from exc
        return "".join(pieces), served

    @activity.defn(name="rlhf_queue_policy_samples")
    async def queue_policy_samples(self, params: CollectInput) -> CollectResult:
        """Steps 1-3 of the module docstring."""
        if len(params.temperatures) != 2:
            raise ApplicationError("temperatures must hold two values", non_retryable=True)
        path = resolve_data_path(params.dataset)
        try:
            drawn = await asyncio.to_thread(
                dataset_prompts, path, params.dataset_prompts, params.seed, params.max_prompt_chars
            )
        except FileNotFoundError:
            raise ApplicationError(
                f"prompt dataset {path} does not exist", type="MissingDataset", non_retryable=True
            ) from None
        production = [
            p for p in await self._production(params.production_prompts) if len(p) <= params.max_prompt_chars
        ]
        prompts = list(dict.fromkeys([*drawn, *production]))
        skipped: dict[str, int] = {}
        served: set[str] = set()
        items: list[feedback_pb2.NewComparison] = []
        limit = asyncio.Semaphore(CONCURRENCY)
        async with make_channel(self._gateway_target, token=self._gateway_token) as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)

            async def compare(index: int, prompt: str) -> feedback_pb2.NewComparison | None:
                base = int.from_bytes(hashlib.sha256(f"{params.seed}:{prompt}".encode()).digest()[:6], "big")
                async with limit:
                    first = await self._sample(stub, params, prompt, params.temperatures[0], base)
                    second = await self._sample(stub, params, prompt, params.temperatures[1], base + 1)
                if first is None or second is None:
                    skipped["refused_by_gateway"] = skipped.get("refused_by_gateway", 0) + 1
                    return None
                (one, by_one), (two, by_two) = first, second
                served.update(s for s in (by_one, by_two) if s)
                if not one.strip() or not two.strip():
                    skipped["empty_response"] = skipped.get("empty_response", 0) + 1
                    return None
                if one.strip() == two.strip():
                    skipped["identical_responses"] = skipped.get("identical_responses", 0) + 1
                    return None
                t1, t2 = params.temperatures
                return feedback_pb2.NewComparison(
                    key=f"p{index}",
                    prompt=prompt,
                    response_1=one,
                    model_1=f"{by_one or params.model}@t={t1:g}",
                    response_2=two,
                    model_2=f"{by_two or params.model}@t={t2:g}",
                )

            made = await asyncio.gather(*(compare(i, p) for i, p in enumerate(prompts)))
        items = [m for m in made if m is not None]
        queued = 0
        if items:
            async with make_channel(self._feedback_target, token=self._feedback_token) as channel:
                feedback = feedback_pb2_grpc.PreferenceFeedbackServiceStub(channel)
                try:
                    reply = await feedback.AddComparisons(
                        feedback_pb2.AddComparisonsRequest(
                            batch=params.batch, origin="policy", comparisons=items
                        ),
                        timeout=self._rpc_timeout_s,
                    )
                except grpc.aio.AioRpcError as exc:
                    raise failed("AddComparisons", exc) from exc
            queued = reply.added + reply.already_present
        activity.logger.info(
            "rlhf batch %s: %d dataset + %d production prompts, %d comparisons queued, skipped %s",
            params.batch,
            len(drawn),
            len(production),
            queued,
            skipped,
        )
        return CollectResult(
            dataset_prompts=len(drawn),
            production_prompts=len(production),
            queued=queued,
            skipped=skipped,
            served_by=", ".join(sorted(served)),
        )
