"""The OpenAI-compatible HTTP API, as ``vllm serve`` exposes it: translation only.

Routes turn JSON into a :class:`GenerationRequest`, call :class:`ModelServer`, and turn chunks into
OpenAI bodies or server-sent events. Every error is an OpenAI error body
(``{"error": {"message", "type", "param", "code"}}``) with the status vLLM would answer.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from forge_kit import errors
from forge_kit.http import require_token
from forge_kit.openai_errors import install_openai_error_handlers, openai_error
from forge_kit.openai_protocol import (
    ChatCompletionBody,
    CompletionBody,
    SamplingBody,
)
from forge_model_server.entrypoints.image_inputs import ImagePolicy, chat_messages
from forge_model_server.entrypoints.tokenizer_api import install_tokenizer_api
from forge_model_server.sample.params import chat_requests, completion_requests, merged
from forge_model_server.service import (
    ChunkStream,
    GenerationChunk,
    GenerationRequest,
    ModelInfo,
    ModelNotFoundError,
    ModelNotLoadedError,
    ModelServer,
    TokenLogprob,
)


def _usage(last: GenerationChunk | None) -> dict[str, int]:
    prompt = last.prompt_tokens if last else 0
    completion = last.completion_tokens if last else 0
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if last is not None and last.image_tokens:
        usage["image_tokens"] = last.image_tokens
    return usage


def _completion_logprobs(
    chunks: list[GenerationChunk], *, echo: bool = False, offset: int = 0
) -> dict[str, object] | None:
    """The legacy completions ``logprobs`` object (tokens, token_logprobs, top_logprobs, text_offset);
    with ``echo`` the prompt's tokens come first, the first of them unscored, as vLLM answers.
    Each token is its share of the decoded text (the runner's incremental detokenization), so
    ``text_offset`` — ``offset`` plus the lengths of the tokens before — is a character offset
    into the returned text."""
    lps: list[TokenLogprob] = []
    if echo:
        lps += next((list(c.prompt_logprobs) for c in chunks if c.prompt_logprobs is not None), [])
    lps += [lp for c in chunks for lp in c.logprobs]
    if not lps:
        return None
    offsets, at = [], offset
    for lp in lps:
        offsets.append(at)
        at += len(lp.token)
    return {
        "tokens": [lp.token for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [dict(lp.top) if lp.logprob is not None else None for lp in lps],
        "text_offset": offsets,
    }


def _chat_logprobs(chunks: list[GenerationChunk]) -> dict[str, object] | None:
    """The chat ``logprobs`` object (``content``: token, logprob, bytes, top_logprobs)."""
    lps = [lp for c in chunks for lp in c.logprobs]
    if not lps:
        return None

    def entry(token: str, logprob: float | None) -> dict[str, object]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps
        ]
    }


def _prompt_logprobs(chunks: list[GenerationChunk]) -> list[dict[str, dict[str, object]] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token, {token id: {logprob, rank, decoded_token}}."""
    first = next((c.prompt_logprobs for c in chunks if c.prompt_logprobs is not None), None)
    if first is None:
        return None
    out: list[dict[str, dict[str, object]] | None] = []
    for lp in first:
        if lp.logprob is None:
            out.append(None)
            continue
        entries: dict[str, dict[str, object]] = {
            str(lp.token_id): {"logprob": lp.logprob, "decoded_token": lp.token}
        }
        for rank, (token, value) in enumerate(lp.top, start=1):
            entries.setdefault(token, {"logprob": value, "rank": rank, "decoded_token": token})
        out.append(entries)
    return out


def _echoed(generation: GenerationRequest, chunks: list[GenerationChunk]) -> str:
    """The prompt as an echo returns it: the text sent, or a token-id prompt decoded (its
    tokens' pieces, which join to the decoded text)."""
    if generation.prompt is not None:
        return generation.prompt
    first = next((c.prompt_logprobs for c in chunks if c.prompt_logprobs is not None), ())
    return "".join(lp.token for lp in first)


async def _collect(chunks: ChunkStream) -> list[GenerationChunk]:
    """Every chunk of a whole (non-streamed) answer."""
    return [chunk async for chunk in chunks]


def _sse(payload: object) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def model_card(model: ModelInfo, loaded: bool) -> dict[str, object]:
    """A ``/v1/models`` entry as vLLM lists it, plus Forge's ``version`` and ``loaded``; ``root`` is
    the model id, never the checkpoint's path on this host."""
    return {
        "id": model.id,
        "object": "model",
        "created": model.created,
        "owned_by": "forge",
        "root": model.id,
        "parent": None,
        "max_model_len": model.max_context_tokens or None,
        "version": model.version,
        "loaded": loaded,
    }


class OpenAIRoutes:
    """Builds the OpenAI routes on a FastAPI app around one :class:`ModelServer`."""

    def __init__(self, server: ModelServer, images: ImagePolicy | None = None) -> None:
        self._server = server
        self._images = images or ImagePolicy()

    async def list_models(self) -> dict[str, object]:
        server = self._server
        return {"object": "list", "data": [model_card(m, server.is_loaded(m)) for m in server.list_models()]}

    async def retrieve_model(self, model_id: str) -> dict[str, object]:
        """``GET /v1/models/{id}``: the model's card, 404 ``model_not_found`` when not served."""
        info = self._server.lookup(model_id)
        return model_card(info, self._server.is_loaded(info))

    async def completions(self, body: CompletionBody, request: Request) -> Response:
        if body.echo and body.stream:
            raise errors.ValidationError("echo", "is not supported with stream")
        request_id = request.headers.get("x-request-id", "") or uuid.uuid4().hex
        return await self._respond(completion_requests(body, request_id), body, request_id, chat=False)

    async def chat_completions(self, body: ChatCompletionBody, request: Request) -> Response:
        request_id = request.headers.get("x-request-id", "") or uuid.uuid4().hex
        messages = await chat_messages(body.messages, self._images)
        return await self._respond(chat_requests(body, request_id, messages), body, request_id, chat=True)

    @staticmethod
    def _choice(
        generation: GenerationRequest, received: list[GenerationChunk], *, chat: bool, echo: bool
    ) -> dict[str, object]:
        """One whole answer's choice (index 0): text or message, finish reason, logprobs."""
        last = received[-1] if received else None
        text = "".join(chunk.text for chunk in received)
        logprobs: dict[str, object] | None = None
        if chat:
            logprobs = _chat_logprobs(received)
        elif generation.logprobs is not None:
            logprobs = _completion_logprobs(received, echo=echo)
        choice: dict[str, object] = {
            "index": 0,
            "finish_reason": last.finish_reason if last else None,
            "logprobs": logprobs,
            "prompt_logprobs": _prompt_logprobs(received),
        }
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = (_echoed(generation, received) if echo else "") + text
        return choice

    async def _respond(
        self, generations: list[GenerationRequest], body: SamplingBody, request_id: str, *, chat: bool
    ) -> Response:
        """Admit every choice before any runs (a refusal refuses the whole call and cancels what
        was admitted, and the engine batches them), then answer whole or as one merged stream:
        choice ``i`` is ``generations[i]``, usage summed over them."""
        admitted: list[ChunkStream] = []
        try:
            for generation in generations:
                info, chunks = await self._server.generate(generation)
                admitted.append(chunks)
        except BaseException:
            for chunks in admitted:
                await chunks.aclose()
            raise
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
            "created": int(time.time()),
            "model": info.id,
        }
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                self._stream(head, admitted, chat=chat, include_usage=include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": request_id},
            )
        try:
            received = await asyncio.gather(*(_collect(chunks) for chunks in admitted))
        finally:
            for chunks in admitted:
                await chunks.aclose()
        echo = isinstance(body, CompletionBody) and body.echo
        choices = [
            {**self._choice(generation, got, chat=chat, echo=echo), "index": i}
            for i, (generation, got) in enumerate(zip(generations, received, strict=True))
        ]
        obj = "chat.completion" if chat else "text_completion"
        usage = _summed([got[-1] if got else None for got in received])
        return JSONResponse({**head, "object": obj, "choices": choices, "usage": usage})

    async def _stream(
        self,
        head: dict[str, object],
        streams: list[ChunkStream],
        *,
        chat: bool,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        last: list[GenerationChunk | None] = [None] * len(streams)
        offsets = [0] * len(streams)
        events = merged(streams)
        try:
            if chat:
                for i in range(len(streams)):
                    first = {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                    yield _sse({**head, "object": obj, "choices": [first]})
            async for i, chunk in events:
                last[i] = chunk
                logprobs = (
                    _chat_logprobs([chunk]) if chat else _completion_logprobs([chunk], offset=offsets[i])
                )
                offsets[i] += sum(len(lp.token) for lp in chunk.logprobs)
                delta: dict[str, object] = {
                    "index": i,
                    "finish_reason": chunk.finish_reason,
                    "logprobs": logprobs,
                }
                if chunk.prompt_logprobs is not None:
                    delta["prompt_logprobs"] = _prompt_logprobs([chunk])
                if chat:
                    delta["delta"] = {"content": chunk.text} if chunk.text else {}
                else:
                    delta["text"] = chunk.text
                yield _sse({**head, "object": obj, "choices": [delta]})
            if include_usage:
                yield _sse({**head, "object": obj, "choices": [], "usage": _summed(last)})
        except errors.ForgeError as exc:
            # Headers are gone; the error travels as an event, as vLLM does mid-stream.
            yield _sse(
                {"error": {"message": exc.message, "type": "server_error", "param": None, "code": None}}
            )
        finally:
            await events.aclose()
            for chunks in streams:
                await chunks.aclose()
        yield b"data: [DONE]\n\n"


def _summed(lasts: list[GenerationChunk | None]) -> dict[str, object]:
    """The usage of a call: summed over its choices; ``prompt_tokens_details.image_tokens`` (of
    ``prompt_tokens``, the positions images filled) when the prompt held images."""
    usage = [_usage(last) for last in lasts]
    out: dict[str, object] = {
        key: sum(u[key] for u in usage) for key in ("prompt_tokens", "completion_tokens", "total_tokens")
    }
    images = sum(u.get("image_tokens", 0) for u in usage)
    if images:
        out["prompt_tokens_details"] = {"image_tokens": images}
    return out


def install_openai_api(
    app: FastAPI, server: ModelServer, token: str | None, images: ImagePolicy | None = None
) -> None:
    """Add ``/v1/*`` (bearer ``token`` when set), ``/health`` and OpenAI-format error handlers;
    ``images`` says which image parts chat requests may carry."""
    routes = OpenAIRoutes(server, images)
    auth = [Depends(require_token(token))]
    app.add_api_route("/v1/models", routes.list_models, methods=["GET"], dependencies=auth)
    app.add_api_route("/v1/models/{model_id:path}", routes.retrieve_model, methods=["GET"], dependencies=auth)
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"], dependencies=auth)
    app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"], dependencies=auth)
    install_tokenizer_api(app, server, auth)

    @app.get("/health", include_in_schema=False)
    async def health() -> Response:
        return Response(status_code=200)

    install_openai_error_handlers(app)

    async def _model_missing(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ModelNotFoundError | ModelNotLoadedError)
        return openai_error(404, exc.message, param="model", code="model_not_found")

    app.add_exception_handler(ModelNotFoundError, _model_missing)
    app.add_exception_handler(ModelNotLoadedError, _model_missing)
