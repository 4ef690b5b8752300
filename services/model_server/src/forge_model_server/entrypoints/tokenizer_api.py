"""vLLM's tokenizer routes: ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``.

They are what a harness needs of a served name's tokenizer without a copy of its files:
lm-evaluation-harness's ``local-completions`` finds ``/tokenizer_info`` and ``/tokenize`` and then
tokenizes through them (its remote tokenizer, which sends no ``model``: the one model served is
meant, as on vLLM), and ``forge eval`` splits context and continuation with them. Nothing here
names a path on this host. Translation only; the tokenizer is the engine's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from fastapi import FastAPI, Query
from fastapi.params import Depends

from forge_kit import errors
from forge_kit.openai_protocol import DetokenizeBody, TokenizeBody, message_text
from forge_model_server.service import ChatMessage, GenerationRequest, ModelServer


@runtime_checkable
class SharedTokenizer(Protocol):
    """What an engine shares of its tokenizer; called by these routes only (an engine without it,
    such as a test double, answers 404 on ``/detokenize`` and ``/tokenizer_info``)."""

    def detokenize(self, ids: list[int]) -> str:
        """The text of ``ids`` (a ValidationError naming ``tokens`` for an id outside the vocabulary)."""
        ...

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's ``/tokenizer_info``: special tokens, chat template, context; never a path."""
        ...


class TokenizerRoutes:
    def __init__(self, server: ModelServer) -> None:
        self._server = server

    def _model(self, model: str | None) -> str:
        """``model``, or the one model served when it is omitted."""
        if model:
            return model
        served = [m.id for m in self._server.list_models()]
        if len(served) != 1:
            raise errors.ValidationError("model", f"is required: this server serves {len(served)} models")
        return served[0]

    async def _shared(self, model: str | None) -> tuple[str, SharedTokenizer]:
        info, engine = await self._server.load(self._model(model))
        if not isinstance(engine, SharedTokenizer):
            raise errors.NotFoundError(f"the engine of {info.id} does not share its tokenizer")
        return info.id, engine

    async def tokenize(self, body: TokenizeBody) -> dict[str, object]:
        """The ids generation would feed the model (or, with ``add_special_tokens: false``, a
        text prompt's ids without the tokens the tokenizer adds around it), their count and the
        model's context, so a caller can fit a prompt with the serving tokenizer."""
        if not body.add_generation_prompt:
            raise errors.ValidationError(
                "add_generation_prompt", "only true is supported (the prompt as generation sees it)"
            )
        if not body.add_special_tokens and body.messages is not None:
            raise errors.ValidationError(
                "add_special_tokens", "false is supported for a prompt, not messages"
            )
        messages = (
            [ChatMessage(m.role, message_text(m, i)) for i, m in enumerate(body.messages)]
            if body.messages is not None
            else None
        )
        request = GenerationRequest(
            model=self._model(body.model),
            prompt=body.prompt,
            messages=messages,
            add_special_tokens=body.add_special_tokens,
        )
        info, tokens = await self._server.tokenize(request)
        return {
            "count": len(tokens),
            "max_model_len": info.max_context_tokens or None,
            "tokens": tokens,
            "token_strs": None,
        }

    async def detokenize(self, body: DetokenizeBody) -> dict[str, object]:
        _, engine = await self._shared(body.model)
        return {"prompt": engine.detokenize(list(body.tokens))}

    async def tokenizer_info(
        self, model: str | None = Query(default=None, max_length=256)
    ) -> dict[str, object]:
        _, engine = await self._shared(model)
        return engine.tokenizer_info()


def install_tokenizer_api(app: FastAPI, server: ModelServer, auth: Sequence[Depends]) -> None:
    routes = TokenizerRoutes(server)
    app.add_api_route("/tokenize", routes.tokenize, methods=["POST"], dependencies=list(auth))
    app.add_api_route("/detokenize", routes.detokenize, methods=["POST"], dependencies=list(auth))
    app.add_api_route("/tokenizer_info", routes.tokenizer_info, methods=["GET"], dependencies=list(auth))
