"""The model backend: any OpenAI-compatible endpoint (the gateway, a ``model_server``, vLLM).

Generation goes to ``/v1/completions`` (or ``/v1/chat/completions`` for chat tasks);
log-likelihoods come from prompt logprobs as vLLM returns them, located by tokens as
lm-evaluation-harness locates them: the context and context + continuation are tokenized by the
served model's own tokenizer (``POST /tokenize``, vLLM's route, on the model server and the
gateway), the whole is sent as a token-id prompt with ``echo: true, logprobs: 1, max_tokens: 1``,
and the continuation's log-likelihood is the sum over the tokens after the context's count —
never an offset into decoded text.

Every single-prompt request is first looked up in a :class:`ResponseCache` keyed by the request
body **and** the model identity (checkpoint, tokenizer and chat-template hashes): a re-run of an
unchanged spec makes no model calls, and a different checkpoint served under the same name never
reads another checkpoint's answers (lm-evaluation-harness #4063). Misses are packed into batches
of ``batch_size`` prompts and sent with at most ``concurrency`` requests in flight — a ceiling, not
a demand: the window adapts to the server (``forge_kit.backoff``: 429/503 halve it and their
``Retry-After`` pauses every request, successes grow it back), overloads are retried for as long as
the policy's patience lasts, connection errors and 5xx a few times, and anything else (400, 401,
404) fails the run at once. A retry re-sends the same batch and answers are placed by their
``index``, so a retry never counts twice.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import random
import sqlite3
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from forge_kit.backoff import AIMDLimiter, GaveUp, RetryPolicy, RetryStats, TooLarge, send_with_retries
from forge_kit.images import image_mime
from forge_kit.paths import private_file

WEIGHT_FILES = (
    "*.safetensors",
    "*.bin",
    "config.json",
    "generation_config.json",
    # A vision-language checkpoint's image preprocessing decides its answers as much as its weights.
    "preprocessor_config.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "special_tokens_map.json")


class BackendError(Exception):
    """The endpoint cannot answer; the message says why."""


class _TooLarge(Exception):
    """A batch the server refused as overloaded while alone in flight: split it."""


_SPLIT_AFTER = 3
"""Overload answers to a batch sent alone (the window at one request) before it is halved."""


@dataclass(frozen=True)
class ModelIdentity:
    """What a result depends on about the model. ``source`` is ``files`` when the hashes were
    computed from the checkpoint folder, ``declared`` when only the endpoint's model card was seen."""

    name: str
    checkpoint_sha256: str
    tokenizer_sha256: str
    chat_template_sha256: str
    source: str

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()


def declared_identity(model: str, version: object, root: object = None) -> ModelIdentity:
    """The identity of a model known only by its card: its id, root and version."""
    declared = json.dumps({"id": model, "root": root, "version": version}, sort_keys=True)
    return ModelIdentity(model, hashlib.sha256(declared.encode()).hexdigest(), "", "", "declared")


def _hash_files(paths: Sequence[Path], base: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(f"{path.relative_to(base).as_posix()}\n".encode())
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def identity_from_checkpoint(name: str, folder: Path) -> ModelIdentity:
    """Hash a Hugging Face checkpoint folder: weights + config, tokenizer, chat template."""
    if not folder.is_dir():
        raise BackendError(f"checkpoint folder {folder} does not exist")
    weights = [p for pattern in WEIGHT_FILES for p in folder.glob(pattern)]
    if not weights:
        raise BackendError(f"checkpoint folder {folder} holds no weights or config.json")
    tokenizer = [folder / f for f in TOKENIZER_FILES if (folder / f).is_file()]
    template = ""
    config_path = folder / "tokenizer_config.json"
    if config_path.is_file():
        template = str(json.loads(config_path.read_text()).get("chat_template") or "")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    return ModelIdentity(
        name=name,
        checkpoint_sha256=_hash_files(weights, folder),
        tokenizer_sha256=_hash_files(tokenizer, folder) if tokenizer else "",
        chat_template_sha256=hashlib.sha256(template.encode()).hexdigest() if template else "",
        source="files",
    )


class ResponseCache:
    """A SQLite table of request key → response JSON, safe to share between runs and threads."""

    def __init__(self, path: Path) -> None:
        self._conn = sqlite3.connect(private_file(path), check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("CREATE TABLE IF NOT EXISTS responses (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        self._lock = threading.Lock()

    def get(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._conn.execute("SELECT value FROM responses WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else None

    def put_many(self, items: Sequence[tuple[str, dict[str, Any]]]) -> None:
        with self._lock:
            self._conn.executemany(
                "INSERT OR REPLACE INTO responses (key, value) VALUES (?, ?)",
                [(k, json.dumps(v, sort_keys=True)) for k, v in items],
            )

    def close(self) -> None:
        self._conn.close()


@dataclass(frozen=True)
class Request:
    """One prompt's request: the route and the body (with a single string prompt)."""

    path: str
    body: dict[str, Any]

    def key(self, identity: ModelIdentity) -> str:
        blob = json.dumps({"model": identity.digest(), "path": self.path, "body": self.body}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    def batch_key(self) -> str:
        """Requests with equal batch keys differ only in their prompt and can share an HTTP call."""
        if self.path != "/v1/completions":
            return f"unbatchable:{id(self)}"
        return json.dumps({k: v for k, v in self.body.items() if k != "prompt"}, sort_keys=True)


@dataclass
class CallStats:
    """What a run cost: requests answered from the cache, prompts sent, HTTP calls and retries."""

    cache_hits: int = 0
    prompts_sent: int = 0
    model_calls: int = 0
    retries: int = 0
    overloads: int = 0
    """429/503 answers: each halves the window of requests in flight (once per congestion event)."""
    batches_split: int = 0
    """Batches halved because the server refused them as overloaded even alone (a queue smaller
    than the batch)."""
    lowest_concurrency: int = 0
    """The smallest the adaptive window became (the ``concurrency`` asked for when never cut)."""
    per_batch: list[int] = field(default_factory=list)


class OpenAIBackend:
    """Sends :class:`Request` objects to one OpenAI-compatible endpoint, through the cache."""

    def __init__(
        self,
        endpoint: str,
        model: str,
        *,
        cache: ResponseCache | None = None,
        token: str = "",
        batch_size: int = 16,
        concurrency: int = 8,
        attempts: int = 6,
        overload_patience_s: float = 900.0,
        timeout_s: float = 120.0,
        transport: httpx.AsyncBaseTransport | None = None,
        rng: random.Random | None = None,
        sleep: Callable[[float], Any] = asyncio.sleep,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.endpoint = endpoint.rstrip("/")
        self.model = model
        self.cache = cache
        self.batch_size = batch_size
        self.concurrency = concurrency
        self.stats = CallStats(lowest_concurrency=concurrency)
        self.on_answers: Callable[[int], None] = lambda count: None
        """Called with the number of requests answered (from the cache or a batch), for progress."""
        self.max_model_len: int | None = None
        self.served_version = ""
        """The version the served model's card declares (empty: it declares none)."""
        """The served model's context in tokens (its card's ``max_model_len``), once known."""
        self.limiter = AIMDLimiter(concurrency)
        self._policy = RetryPolicy(attempts=attempts, overload_patience_s=overload_patience_s)
        self._retry_stats = RetryStats()
        self._batching = True
        self._batch_cap = batch_size
        """Prompts per call at most: halved whenever the server refuses a batch even alone."""
        self._rng = rng or random.Random(0)
        self._sleep = sleep
        # One kept-alive connection per request in flight: httpx's default pool (100 connections,
        # 20 kept alive) would cap the concurrency at 100 and reconnect for every request above 20.
        self._client = httpx.AsyncClient(
            base_url=self.endpoint,
            headers={"Authorization": f"Bearer {token}"} if token else {},
            timeout=timeout_s,
            transport=transport,
            limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def identity(self, checkpoint: Path | None = None) -> ModelIdentity:
        """The served model's identity: hashed from ``checkpoint`` (or the card's ``root`` when that
        is a local folder), else declared from its model card (id, root, version)."""
        try:
            response = await self._client.get("/v1/models")
            response.raise_for_status()
            cards = [c for c in response.json().get("data", []) if isinstance(c, dict)]
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            raise BackendError(
                f"model endpoint {self.endpoint} is unreachable or not OpenAI-compatible: {exc!r}"
            ) from exc
        card = next((c for c in cards if c.get("id") == self.model), None)
        if card is None:
            served = [c.get("id") for c in cards]
            raise BackendError(
                f"model endpoint {self.endpoint} does not serve {self.model!r} (it serves {served})"
            )
        context = card.get("max_model_len")
        self.max_model_len = context if isinstance(context, int) and context > 0 else None
        self.served_version = str(card.get("version") or "")
        root = card.get("root")
        folder = checkpoint or (Path(root) if isinstance(root, str) and Path(root).is_dir() else None)
        if folder is not None:
            return identity_from_checkpoint(self.model, folder)
        return declared_identity(self.model, card.get("version"), card.get("root"))

    async def tokenize(self, prompts: Sequence[str], identity: ModelIdentity) -> list[list[int]]:
        """The served model's token ids of each prompt (``POST /tokenize``, as vLLM answers it),
        through the cache (keyed by the model identity, like every answer) and the retry policy."""
        out: list[list[int] | None] = [None] * len(prompts)
        unique = sorted(set(prompts))
        keys = {p: Request("/tokenize", {"model": self.model, "prompt": p}).key(identity) for p in unique}
        known: dict[str, list[int]] = {}
        for prompt in unique:
            cached = self.cache.get(keys[prompt]) if self.cache else None
            if cached is not None:
                known[prompt] = list(cached["tokens"])
        gate = asyncio.Semaphore(self.concurrency)

        async def one(prompt: str) -> None:
            async with gate:
                known[prompt] = await self._tokenize_one(prompt)
            if self.cache:
                self.cache.put_many([(keys[prompt], {"tokens": known[prompt]})])

        await asyncio.gather(*(one(p) for p in unique if p not in known))
        for i, prompt in enumerate(prompts):
            out[i] = known[prompt]
        return [o for o in out if o is not None]

    async def _tokenize_one(self, prompt: str) -> list[int]:
        async def call() -> httpx.Response:
            return await self._client.post("/tokenize", json={"model": self.model, "prompt": prompt})

        try:
            response = await send_with_retries(
                call,
                self.limiter,
                policy=self._policy,
                stats=self._retry_stats,
                rng=self._rng,
                sleep=self._sleep,
            )
        except (GaveUp, TooLarge) as exc:
            raise BackendError(f"model endpoint {self.endpoint} gave up on /tokenize: {exc}") from None
        if response.status_code >= 400:
            raise BackendError(
                f"model endpoint {self.endpoint} cannot tokenize for {self.model!r} (it must serve "
                f"POST /tokenize, as vLLM does): HTTP {response.status_code} {response.text[:300]}"
            )
        tokens = response.json().get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise BackendError(f"model endpoint {self.endpoint} answered /tokenize without token ids")
        return tokens

    async def run(self, requests: Sequence[Request], identity: ModelIdentity) -> list[dict[str, Any]]:
        """One response per request, in order.

        1. Answer what the cache holds; 2. pack the misses into batches of prompts that differ only
        in the prompt; 3. send the batches, at most ``concurrency`` at once; 4. store every answer
        in the cache as its batch returns, so an interrupted run resumes where it stopped.
        """
        out: list[dict[str, Any] | None] = [None] * len(requests)
        keys = [r.key(identity) for r in requests]
        misses: dict[str, list[int]] = {}
        for i, (request, key) in enumerate(zip(requests, keys, strict=True)):
            cached = self.cache.get(key) if self.cache else None
            if cached is not None:
                out[i] = cached
                self.stats.cache_hits += 1
            else:
                misses.setdefault(request.batch_key(), []).append(i)
        cached_here = len(requests) - sum(len(ids) for ids in misses.values())
        if cached_here:
            self.on_answers(cached_here)
        batches = [
            ids[start : start + self.batch_size]
            for ids in misses.values()
            for start in range(0, len(ids), self.batch_size)
        ]

        async def send(ids: list[int]) -> None:
            if len(ids) > self._batch_cap:  # a batch this large was refused even alone before
                cap = self._batch_cap
                await asyncio.gather(*(send(ids[i : i + cap]) for i in range(0, len(ids), cap)))
                return
            try:
                answers = await self._post([requests[i] for i in ids])
            except _TooLarge:  # more prompts than the server's queue holds: halve the batch
                self.stats.batches_split += 1
                half = len(ids) // 2
                self._batch_cap = min(self._batch_cap, half)
                await asyncio.gather(send(ids[:half]), send(ids[half:]))
                return
            if answers is None:  # the endpoint takes one prompt per request: split the batch
                await asyncio.gather(*(send([i]) for i in ids))
                return
            for i, answer in zip(ids, answers, strict=True):
                out[i] = answer
            self.on_answers(len(ids))
            if self.cache:
                self.cache.put_many([(keys[i], a) for i, a in zip(ids, answers, strict=True)])

        await asyncio.gather(*(send(ids) for ids in batches))
        return [o for o in out if o is not None]

    async def _post(self, batch: list[Request]) -> list[dict[str, Any]] | None:
        """One HTTP call for ``batch`` through the adaptive limiter and retry policy; the answers
        split back per prompt by choice ``index``. None when the endpoint refuses a list of prompts
        (400/422; e.g. an endpoint that takes one prompt per request): batching is then switched
        off for the rest of the run."""
        first = batch[0]
        if len(batch) > 1 and not self._batching:
            return None
        body = dict(first.body)
        if len(batch) > 1:
            body["prompt"] = [r.body["prompt"] for r in batch]
        n = int(body.get("n", 1))

        async def call() -> httpx.Response:
            self.stats.model_calls += 1
            return await self._client.post(first.path, json=body)

        try:
            response = await send_with_retries(
                call,
                self.limiter,
                policy=self._policy,
                stats=self._retry_stats,
                rng=self._rng,
                sleep=self._sleep,
                split_after=_SPLIT_AFTER if len(batch) > 1 else None,
            )
        except TooLarge:
            raise _TooLarge from None
        except GaveUp as exc:
            raise BackendError(
                f"model endpoint {self.endpoint} gave up on {first.path}: {exc} (last: {exc.last})"
            ) from None
        finally:
            self.stats.retries = self._retry_stats.retries
            self.stats.overloads = self._retry_stats.overloads
            self.stats.lowest_concurrency = max(1, int(self.limiter.lowest))
        if response.status_code in (400, 422) and len(batch) > 1:
            self._batching = False
            return None
        if response.status_code >= 400:
            raise BackendError(
                f"model endpoint {self.endpoint} refused {first.path}: HTTP {response.status_code} {response.text[:300]}"
            )
        self.stats.prompts_sent += len(batch)
        self.stats.per_batch.append(len(batch))
        return _split(response.json(), len(batch), n, self.endpoint)


def _split(payload: dict[str, Any], prompts: int, n: int, endpoint: str) -> list[dict[str, Any]]:
    choices = payload.get("choices")
    if not isinstance(choices, list) or len(choices) != prompts * n:
        raise BackendError(
            f"model endpoint {endpoint} returned {len(choices or [])} choices for {prompts}×{n}"
        )
    ordered = sorted(choices, key=lambda c: int(c.get("index", 0)))
    return [
        {"choices": [{k: v for k, v in c.items() if k != "index"} for c in ordered[p * n : (p + 1) * n]]}
        for p in range(prompts)
    ]


# --- request builders and response readers -----------------------------------------------------


def generate_request(
    model: str, prompt: str, gen: dict[str, Any], seed: int, *, chat: bool, image: bytes = b""
) -> Request:
    """A completion, or a one-message chat; with ``image``, the message is an ``image_url`` part
    (a base64 data URI) then the prompt's text part."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": gen["max_tokens"],
        "temperature": gen["temperature"],
        "top_p": gen["top_p"],
        "n": gen["n"],
        "seed": seed,
    }
    if gen["stop"]:
        body["stop"] = list(gen["stop"])
    if chat and image:
        url = f"data:{image_mime(image)};base64,{base64.b64encode(image).decode()}"
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": prompt}]
        return Request("/v1/chat/completions", {**body, "messages": [{"role": "user", "content": content}]})
    if chat:
        return Request("/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]})
    return Request("/v1/completions", {**body, "prompt": prompt})


def logprob_request(model: str, prompt: str | list[int]) -> Request:
    """Prompt logprobs for ``prompt`` (vLLM: echo the prompt, one generated token, top-1 logprobs;
    lm-evaluation-harness's ``local-completions`` body)."""
    return Request(
        "/v1/completions",
        {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "echo": True, "logprobs": 1},
    )


@dataclass(frozen=True)
class Continuation:
    """A (context, continuation) pair in tokens, as lm-evaluation-harness splits it: the
    context's trailing whitespace moves to the continuation, ``whole`` is the tokenization of
    context + continuation and its tokens from ``context_tokens`` on are the continuation's."""

    context: str
    continuation: str

    @classmethod
    def split(cls, context: str, continuation: str) -> Continuation:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        return cls(context, continuation)


def continuation_requests(
    model: str, pairs: Sequence[Continuation], tokens: dict[str, list[int]]
) -> list[tuple[Request, int, int]]:
    """Per pair: its logprob request, the context's token count and the prompt's. The prompt is
    the context's tokens then the whole's beyond that count (lm-evaluation-harness's
    ``context_enc + continuation_enc``); ``tokens`` maps each context and each context +
    continuation to its token ids."""
    out = []
    for pair in pairs:
        context = tokens[pair.context] if pair.context else []
        prompt = context + tokens[pair.context + pair.continuation][len(context) :]
        out.append((logprob_request(model, prompt), len(context), len(prompt)))
    return out


def texts(response: dict[str, Any]) -> list[str]:
    out = []
    for choice in response["choices"]:
        message = choice.get("message")
        out.append(
            str(message.get("content") or "") if isinstance(message, dict) else str(choice.get("text", ""))
        )
    return out


def _prompt_logprobs(
    response: dict[str, Any], prompt: str
) -> tuple[list[str], list[float | None], list[int], list[Any]]:
    logprobs = response["choices"][0].get("logprobs") or {}
    tokens, values, offsets = (logprobs.get(k) for k in ("tokens", "token_logprobs", "text_offset"))
    if not (isinstance(tokens, list) and isinstance(values, list) and isinstance(offsets, list)):
        raise BackendError(
            "the endpoint returned no prompt logprobs (tokens, token_logprobs, text_offset); it must support "
            "echo=true with logprobs on /v1/completions, as vLLM does"
        )
    top = logprobs.get("top_logprobs") or [None] * len(tokens)
    keep = [i for i, off in enumerate(offsets) if off < len(prompt)]
    return (
        [tokens[i] for i in keep],
        [values[i] for i in keep],
        [offsets[i] for i in keep],
        [top[i] for i in keep],
    )


def continuation_loglikelihood(
    response: dict[str, Any], context_tokens: int, whole_tokens: int
) -> dict[str, Any]:
    """Sum of the logprobs of the echoed prompt's tokens ``context_tokens`` … ``whole_tokens``
    (the continuation's, located by count as lm-evaluation-harness does) and whether each was
    the greedy choice."""
    logprobs = response["choices"][0].get("logprobs") or {}
    values, top = logprobs.get("token_logprobs"), logprobs.get("top_logprobs")
    if not isinstance(values, list) or len(values) < whole_tokens:
        raise BackendError(
            "the endpoint returned no prompt logprobs (token_logprobs for every prompt token); it must "
            "support echo=true with logprobs and token-id prompts on /v1/completions, as vLLM does"
        )
    top = top if isinstance(top, list) and len(top) >= whole_tokens else [None] * whole_tokens
    picked = range(max(1, context_tokens), whole_tokens)
    if not picked or any(values[i] is None for i in picked):
        raise BackendError("no scored tokens cover the continuation")
    greedy = all(
        not isinstance(top[i], dict) or not top[i] or float(values[i]) >= max(top[i].values()) - 1e-6
        for i in picked
    )
    return {"logprob": sum(float(values[i]) for i in picked), "greedy": greedy, "tokens": len(picked)}


def rolling_loglikelihood(response: dict[str, Any], text: str) -> dict[str, Any]:
    """Log-likelihood of ``text`` after its first token (which has no context to be scored on)."""
    _, values, offsets, _ = _prompt_logprobs(response, text)
    scored = [i for i, v in enumerate(values) if v is not None]
    if not scored:
        raise BackendError("the endpoint scored no token of the text")
    span = text[offsets[scored[0]] :]
    return {
        "logprob": sum(float(values[i] or 0.0) for i in scored),
        "tokens": len(scored),
        "bytes": len(span.encode()),
        "words": len(span.split()),
    }
