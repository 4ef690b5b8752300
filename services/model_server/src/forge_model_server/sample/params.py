"""From an OpenAI request body to the :class:`GenerationRequest` list it asks for: one per prompt
and choice (``n``), each with the body's sampling parameters; and the merge of their streams.

The bodies and the range checks of the sampling parameters are the kit's
(:mod:`forge_kit.openai_protocol`), shared with the gateway; what depends on the model (token ids
within the vocabulary) is checked by the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from forge_kit import errors
from forge_kit.openai_protocol import (
    ChatCompletionBody,
    CompletionBody,
    SamplingBody,
    check_sampling,
    logit_bias,
    message_text,
)
from forge_model_server.service import ChatMessage, ChunkStream, GenerationChunk, GenerationRequest

#: Most prompts one ``/v1/completions`` call may carry as a list.
MAX_PROMPTS = 256
#: Most choices (prompts × ``n``) one call may ask for.
MAX_CHOICES = 256

Prompt = str | list[int]


def _stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def generation_request(body: SamplingBody, request_id: str, **kwargs: Any) -> GenerationRequest:
    """The request of one choice: the body's sampling parameters, checked, and ``kwargs``."""
    check_sampling(body)
    generation = GenerationRequest(
        model=body.model,
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=_stops(body.stop),
        priority=body.priority,
        top_k=body.top_k if body.top_k not in (None, -1, 0) else None,
        prompt_logprobs=body.prompt_logprobs,
        ignore_eos=body.ignore_eos,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=logit_bias(body.logit_bias),
        min_tokens=body.min_tokens,
        **kwargs,
    )
    if request_id:
        generation.request_id = request_id
    return generation


def completion_prompts(body: CompletionBody) -> list[Prompt]:
    """The prompts of a completions body: a text, a list of texts, token ids or lists of them."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise errors.ValidationError("prompt", "must not be an empty list")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    prompts: list[Prompt] = list(prompt)  # type: ignore[arg-type]
    if len(prompts) > MAX_PROMPTS:
        raise errors.ValidationError(
            "prompt", f"a list must hold 1 to {MAX_PROMPTS} prompts, got {len(prompts)}"
        )
    return prompts


def completion_requests(body: CompletionBody, request_id: str) -> list[GenerationRequest]:
    """One request per prompt and choice, in vLLM's order (prompt-major)."""
    prompts = completion_prompts(body)
    if len(prompts) * body.n > MAX_CHOICES:
        raise errors.ValidationError(
            "n", f"{len(prompts)} prompts x n={body.n} exceed {MAX_CHOICES} choices in one call"
        )
    out = []
    for i, prompt in enumerate(prompts):
        kwargs: dict[str, Any] = (
            {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}
        )
        generation = generation_request(
            body, f"{request_id}-{i}" if len(prompts) > 1 else request_id, **kwargs
        )
        generation.logprobs = body.logprobs
        if body.echo and body.logprobs is not None and generation.prompt_logprobs is None:
            generation.prompt_logprobs = body.logprobs
        elif body.echo and generation.prompt is None and generation.prompt_logprobs is None:
            # An echoed token-id prompt's text is its tokens' pieces, which come with its logprobs.
            generation.prompt_logprobs = 0
        out += choices(generation, body.n)
    return out


def chat_requests(
    body: ChatCompletionBody, request_id: str, messages: list[ChatMessage] | None = None
) -> list[GenerationRequest]:
    """One request per choice; ``messages`` are the body's with their images read
    (:mod:`.image_inputs`), else the body's texts (an image part refused)."""
    if messages is None:
        messages = [ChatMessage(m.role, message_text(m, i)) for i, m in enumerate(body.messages)]
    generation = generation_request(body, request_id, messages=messages)
    if body.max_completion_tokens is not None:
        generation.max_tokens = body.max_completion_tokens
    if body.logprobs:
        generation.logprobs = body.top_logprobs or 0
    elif body.top_logprobs is not None:
        raise errors.ValidationError("top_logprobs", "needs logprobs: true")
    return choices(generation, body.n)


def choices(generation: GenerationRequest, n: int) -> list[GenerationRequest]:
    """``n`` copies of ``generation``, each its own request (id ``…-cK``); a seeded request's
    choices get seeds ``seed``, ``seed+1``, … so they differ yet repeat."""
    if n == 1:
        return [generation]
    return [
        dataclasses.replace(
            generation,
            request_id=f"{generation.request_id}-c{k}",
            seed=None if generation.seed is None else generation.seed + k,
        )
        for k in range(n)
    ]


async def merged(streams: Sequence[ChunkStream]) -> AsyncGenerator[tuple[int, GenerationChunk], None]:
    """The chunks of several streams as they come, each with its stream's index; closing this
    closes them all, and an error of one ends it."""
    if len(streams) == 1:
        async for chunk in streams[0]:
            yield 0, chunk
        return
    queue: asyncio.Queue[tuple[int, GenerationChunk | Exception | None]] = asyncio.Queue()

    async def pump(i: int, stream: ChunkStream) -> None:
        try:
            async for chunk in stream:
                await queue.put((i, chunk))
            await queue.put((i, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
