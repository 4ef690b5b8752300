"""A RAG answer in the shape of OpenAI's chat completions: a whole ``chat.completion`` or its
stream as ``chat.completion.chunk`` events, with the retrieval report under ``retrieval``."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping

#: What a chat completion with retrieval reports of the RAG path, under ``retrieval``.
_RETRIEVAL_REPORT = ("passages", "citations", "retrieval", "rerank", "context", "timings_ms", "cached")


def _chat_id(result: Mapping[str, object]) -> str:
    return "chatcmpl-" + str(result.get("id", "")).removeprefix("rag-")


def rag_tokens(result: Mapping[str, object]) -> int:
    """Prompt plus completion tokens a RAG answer spent (none when it was replayed from the cache)."""
    report = result.get("retrieval")
    if result.get("cached") is True or (isinstance(report, dict) and report.get("cached") is True):
        return 0
    return _usage(result)["total_tokens"]


def _usage(result: Mapping[str, object]) -> dict[str, int]:
    raw = result.get("usage")
    usage = {k: int(v) for k, v in raw.items() if isinstance(v, int)} if isinstance(raw, dict) else {}
    usage["total_tokens"] = usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
    return usage


def chat_completion(result: Mapping[str, object], created: int) -> dict[str, object]:
    """A RAG answer as an OpenAI ``chat.completion``."""
    return {
        "id": _chat_id(result),
        "object": "chat.completion",
        "created": created,
        "model": result.get("model"),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": result.get("answer", "")},
                "finish_reason": result.get("finish_reason", "stop"),
            }
        ],
        "usage": _usage(result),
        "retrieval": {k: result[k] for k in _RETRIEVAL_REPORT if k in result},
    }


async def chat_chunks(
    events: AsyncIterator[dict[str, object]], created: int
) -> AsyncIterator[dict[str, object]]:
    """RAG stream events as ``chat.completion.chunk`` events: the answer's pieces as content
    deltas, then a last chunk with the finish reason, the usage and the retrieval report."""
    chunk_id, first = "chatcmpl-" + uuid.uuid4().hex[:16], True
    try:
        async for event in events:
            if event.get("object") == "rag.answer.delta":
                delta: dict[str, object] = {"content": event.get("delta", "")}
                if first:
                    delta["role"], first = "assistant", False
                choice = {"index": 0, "delta": delta, "finish_reason": None}
                yield {
                    "id": chunk_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "choices": [choice],
                }
                continue
            whole = chat_completion(event, created)
            yield {
                "id": chunk_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": whole["model"],
                "choices": [{"index": 0, "delta": {}, "finish_reason": event.get("finish_reason", "stop")}],
                "usage": whole["usage"],
                "retrieval": whole["retrieval"],
            }
    finally:
        if isinstance(events, AsyncGenerator):
            await events.aclose()
