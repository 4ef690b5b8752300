"""A real, tiny language model behind an OpenAI-compatible HTTP app, for the eval tests.

The model is a character trigram model with add-k smoothing trained on a text given by the test:
every token is one character (its id is the code point), so ``text_offset`` is the character
index, and every logprob the app returns is computed from the model's counts — the tests check the
harness against :meth:`NGramModel.logprob` computed directly, not against canned numbers. The app
speaks the vLLM dialect of ``/v1/completions``: a string, token ids or a list of either as the
prompt, ``n``, ``stop``, ``seed``, and ``echo`` + ``logprobs`` for prompt logprobs (the first token
has ``None``); and ``POST /tokenize``.
"""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

VOCAB = [chr(i) for i in range(9, 127)]


class NGramModel:
    """P(c | two previous characters) = (count + k) / (context count + k·|V|)."""

    def __init__(self, text: str, k: float = 0.1) -> None:
        self.k = k
        self._memo: dict[str, dict[str, float]] = {}
        self._greedy: dict[str, str] = {}
        self.counts: dict[str, Counter[str]] = defaultdict(Counter)
        padded = "\x00\x00" + text
        for i in range(2, len(padded)):
            self.counts[padded[i - 2 : i]][padded[i]] += 1

    def next_logprobs(self, context: str) -> dict[str, float]:
        ctx = ("\x00\x00" + context)[-2:]
        cached = self._memo.get(ctx)
        if cached is None:
            cached = self._memo[ctx] = self._distribution(ctx)
        return cached

    def _distribution(self, ctx: str) -> dict[str, float]:
        counts = self.counts.get(ctx, Counter())
        total = sum(counts.values()) + self.k * len(VOCAB)
        return {c: math.log((counts[c] + self.k) / total) for c in VOCAB}

    def token_logprob(self, context: str, char: str) -> float:
        return self.next_logprobs(context).get(char, math.log(self.k / (self.k * len(VOCAB))))

    def logprob(self, context: str, continuation: str) -> float:
        """log P(continuation | context), summed character by character."""
        return sum(
            self.token_logprob(context + continuation[:i], continuation[i]) for i in range(len(continuation))
        )

    def greedy_char(self, context: str) -> str:
        ctx = ("\x00\x00" + context)[-2:]
        best = self._greedy.get(ctx)
        if best is None:
            lps = self.next_logprobs(context)
            best = self._greedy[ctx] = max(VOCAB, key=lambda c: (lps[c], -ord(c)))
        return best


@dataclass
class EndpointState:
    """What the test reads back: how many completion requests and prompts the app answered."""

    models: dict[str, NGramModel]
    completion_requests: int = 0
    prompts: int = 0
    fail_next: int = 0
    single_prompt_only: bool = False
    roots: dict[str, str] = field(default_factory=dict)
    max_model_len: int | None = None
    """The context in tokens (characters): longer prompts + max_tokens are refused with 400."""


def _generate(model: NGramModel, prompt: str, body: dict[str, Any], rng: random.Random) -> str:
    out = ""
    stops = body.get("stop") or []
    stops = [stops] if isinstance(stops, str) else stops
    temperature = float(body.get("temperature", 1.0))
    for _ in range(int(body.get("max_tokens", 16))):
        if temperature == 0:
            char = model.greedy_char(prompt + out)
        else:
            lps = model.next_logprobs(prompt + out)
            weights = [math.exp(lps[c] / temperature) for c in VOCAB]
            char = rng.choices(VOCAB, weights)[0]
        out += char
        hit = [out.index(s) for s in stops if s in out]
        if hit:
            return out[: min(hit)]
    return out


def _echo_logprobs(model: NGramModel, text: str) -> dict[str, Any]:
    tokens, values, offsets, top = [], [], [], []
    for i, char in enumerate(text):
        tokens.append(char)
        offsets.append(i)
        if i == 0:
            values.append(None)
            top.append(None)
            continue
        lps = model.next_logprobs(text[:i])
        best = model.greedy_char(text[:i])
        values.append(model.token_logprob(text[:i], char))
        top.append({best: lps[best], char: values[-1]})
    return {"tokens": tokens, "token_logprobs": values, "text_offset": offsets, "top_logprobs": top}


def prompt_texts(prompt: Any) -> list[str]:
    """The prompts of a body as texts: a string, token ids (code points), or a list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return ["".join(map(chr, prompt))]
    return [p if isinstance(p, str) else "".join(map(chr, p)) for p in prompt]


def make_app(state: EndpointState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "root": state.roots.get(name, name),
                    "version": "1",
                    "max_model_len": state.max_model_len,
                }
                for name in state.models
            ],
        }

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        body = await request.json()
        state.completion_requests += 1
        if state.fail_next > 0:
            state.fail_next -= 1
            return JSONResponse({"error": "try again"}, status_code=503, headers={"retry-after": "0"})
        model = state.models.get(body.get("model", ""))
        if model is None:
            return JSONResponse({"error": {"message": "unknown model"}}, status_code=404)
        prompts = prompt_texts(body["prompt"])
        if state.single_prompt_only and len(prompts) > 1:
            return JSONResponse(
                {"error": {"message": "one prompt per request", "param": "prompt"}}, status_code=422
            )
        too_long = [
            p
            for p in prompts
            if state.max_model_len and len(p) + int(body.get("max_tokens", 16)) > state.max_model_len
        ]
        if too_long:
            message = f"{len(too_long[0])} prompt tokens exceed the context of {state.max_model_len}"
            return JSONResponse({"error": {"message": message, "param": "prompt"}}, status_code=400)
        state.prompts += len(prompts)
        n = int(body.get("n", 1))
        choices = []
        for p_index, prompt in enumerate(prompts):
            rng = random.Random(f"{body.get('seed')}:{prompt}")
            for j in range(n):
                text = _generate(model, prompt, body, rng)
                choice: dict[str, Any] = {"index": p_index * n + j, "text": text, "finish_reason": "length"}
                if body.get("echo"):
                    choice["text"] = prompt + text
                    if body.get("logprobs") is not None:
                        choice["logprobs"] = _echo_logprobs(model, prompt + text)
                choices.append(choice)
        # Answer out of order, as a batching server may: the client must place choices by index.
        return JSONResponse({"object": "text_completion", "model": body["model"], "choices": choices[::-1]})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = await request.json()
        if body.get("model") not in state.models:
            return JSONResponse({"error": {"message": "unknown model"}}, status_code=404)
        tokens = [ord(c) for c in body["prompt"]]
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": state.max_model_len})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        state.completion_requests += 1
        model = state.models[body["model"]]
        prompt = "".join(m["content"] for m in body["messages"])
        text = _generate(model, prompt, body, random.Random(str(body.get("seed"))))
        return JSONResponse({"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]})

    return app
