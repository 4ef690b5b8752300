"""Canary shadow pairs into the raters' queue (an activity of the online RLHF round).

The gateway mirrors a share of an alias's production requests to its shadow model and stores
each pair of answers (``PUT /admin/v1/aliases/{alias}/shadow``, :mod:`forge_inference_gateway.routing.shadow`).
When the round's policy alias has a shadow, the round also queues those pairs as comparisons:

1. read the alias (``GET /admin/v1/aliases``) from the configured gateway URL only, with its
   admin token; no shadow: nothing to queue;
2. page through ``GET /admin/v1/shadow/pairs?alias=…&after_id=…`` from the round's cursor;
3. keep the pairs where both answers came back (HTTP 200), are non-empty and differ, as
   comparisons of production's answer against the shadow's (the prompt as the transcript the
   raters read), and ``AddComparisons`` them under the round's batch with origin ``shadow``,
   keyed by pair id: a retried activity queues nothing twice, and the returned cursor
   (``next_after_id``) keeps the next round from reading them again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
from forge.feedback.v1 import feedback_pb2, feedback_pb2_grpc
from temporalio import activity
from temporalio.exceptions import ApplicationError

from forge_kit.grpckit import make_channel
from forge_orchestrator.activities import failed

#: The gateway's page size limit.
MAX_PAIRS = 500
MAX_REPLY_BYTES = 8 * 1024 * 1024
MAX_TEXT = 8000
"""Prompts and answers longer than this are not queued (raters read them whole)."""
_ALIAS = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")


def alias_name(model: str) -> str:
    """``model`` when it is an alias name (not ``name:version``), else empty."""
    return model if _ALIAS.fullmatch(model) else ""


@dataclass
class ShadowInput:
    batch: str
    alias: str
    """The policy alias whose shadow pairs are queued."""
    after_id: int = 0
    """The cursor: pairs with a larger id only."""
    limit: int = 100


@dataclass
class ShadowResult:
    queued: int = 0
    """Comparisons of this page queued by this call or an earlier try of it."""
    next_after_id: int = 0
    shadowed: bool = False
    """Whether the alias has a shadow now."""
    skipped: dict[str, int] = field(default_factory=dict)


def transcript(request: object) -> str:
    """The stored request as the prompt raters read: chat messages as an HH-style transcript
    ending at the assistant's turn, or a completion's ``prompt``; empty when neither."""
    if not isinstance(request, dict):
        return ""
    messages = request.get("messages")
    if isinstance(messages, list):
        turns = []
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("content"), str):
                return ""
            role = "Assistant" if message.get("role") == "assistant" else "Human"
            turns.append(f"\n\n{role}: {message['content']}")
        return "".join(turns) + "\n\nAssistant:" if turns else ""
    prompt = request.get("prompt")
    return prompt if isinstance(prompt, str) else ""


def comparison(pair: dict[str, Any]) -> tuple[feedback_pb2.NewComparison | None, str]:
    """A stored pair as a comparison, or None and why not."""
    production, shadow = pair.get("production") or {}, pair.get("shadow") or {}
    if str(production.get("status")) != "200" or str(shadow.get("status")) != "200":
        return None, "failed_answer"
    one, two = str(production.get("answer") or ""), str(shadow.get("answer") or "")
    prompt = transcript(pair.get("request"))
    if not prompt or not one.strip() or not two.strip():
        return None, "empty"
    if one.strip() == two.strip():
        return None, "identical_answers"
    if max(len(prompt), len(one), len(two)) > MAX_TEXT or "\x00" in prompt + one + two:
        return None, "too_long_or_binary"
    item = feedback_pb2.NewComparison(
        key=f"shadow-{int(pair['id'])}",
        prompt=prompt,
        response_1=one,
        model_1=str(production.get("model") or "production")[:200],
        response_2=two,
        model_2=f"{str(shadow.get('model') or 'shadow')[:190]}@shadow",
    )
    return item, ""


class ShadowPairs:
    """The activity; the gateway's admin URL and token come from this process's settings."""

    def __init__(
        self, gateway_url: str, gateway_token: str, feedback_target: str, feedback_token: str
    ) -> None:
        self._gateway_url = gateway_url.rstrip("/")
        self._gateway_token = gateway_token
        self._feedback_target = feedback_target
        self._feedback_token = feedback_token

    async def _get(self, http: httpx.AsyncClient, path: str, params: dict[str, Any]) -> dict[str, Any]:
        reply = await http.get(path, params=params)
        if reply.status_code != 200:
            raise ApplicationError(
                f"the gateway's {path} answered HTTP {reply.status_code}: {reply.text[:300]}",
                type="GatewayUnavailable",
            )
        if len(reply.content) > MAX_REPLY_BYTES:
            raise ApplicationError(
                f"the gateway's {path} answered over {MAX_REPLY_BYTES} bytes", non_retryable=True
            )
        body = reply.json()
        if not isinstance(body, dict):
            raise ApplicationError(f"the gateway's {path} answered {type(body).__name__}, not an object")
        return body

    @activity.defn(name="rlhf_queue_shadow_pairs")
    async def queue_shadow_pairs(self, params: ShadowInput) -> ShadowResult:
        """Steps 1-3 of the module docstring."""
        if not _ALIAS.fullmatch(params.alias):
            raise ApplicationError(f"alias {params.alias!r} is not an alias name", non_retryable=True)
        if params.after_id < 0 or not 1 <= params.limit <= MAX_PAIRS:
            raise ApplicationError(f"after_id must be >= 0 and limit 1-{MAX_PAIRS}", non_retryable=True)
        result = ShadowResult(next_after_id=params.after_id)
        if not self._gateway_url:
            return result
        headers = {"Authorization": f"Bearer {self._gateway_token}"}
        async with httpx.AsyncClient(base_url=self._gateway_url, headers=headers, timeout=30) as http:
            # 1.
            aliases = (await self._get(http, "/admin/v1/aliases", {})).get("aliases") or []
            found = [a for a in aliases if isinstance(a, dict) and a.get("alias") == params.alias]
            result.shadowed = bool(found and found[0].get("shadow"))
            if not result.shadowed:
                return result
            # 2.
            page = await self._get(
                http,
                "/admin/v1/shadow/pairs",
                {"alias": params.alias, "after_id": params.after_id, "limit": params.limit},
            )
        pairs = [p for p in page.get("pairs") or [] if isinstance(p, dict) and isinstance(p.get("id"), int)]
        # 3.
        items = []
        for pair in pairs:
            item, why = comparison(pair)
            if item is None:
                result.skipped[why] = result.skipped.get(why, 0) + 1
            else:
                items.append(item)
        if items:
            async with make_channel(self._feedback_target, token=self._feedback_token) as channel:
                feedback = feedback_pb2_grpc.PreferenceFeedbackServiceStub(channel)
                try:
                    reply = await feedback.AddComparisons(
                        feedback_pb2.AddComparisonsRequest(
                            batch=params.batch, origin="shadow", comparisons=items
                        ),
                        timeout=60,
                    )
                except grpc.aio.AioRpcError as exc:
                    raise failed("AddComparisons", exc) from exc
            result.queued = reply.added + reply.already_present
        result.next_after_id = max([params.after_id, *(int(p["id"]) for p in pairs)])
        return result
