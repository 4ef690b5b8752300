"""Model server domain: the model directory, request validation, the engine seam and its metrics.

A model is a Hugging Face-format folder under ``models_dir`` (``config.json``, tokenizer files,
``*.safetensors``); its name is the folder name and its version comes from an optional
``forge_model.json`` (``{"version": "3"}``). An admin may also register a folder elsewhere on this
machine under a name at run time (:meth:`ModelServer.register`: a freshly trained checkpoint); it
is loaded at once and served until the process ends. Generation is delegated to an
:class:`Engine`, which an :class:`EngineLoader` builds for a model on first use. A model that cannot
be loaded is an error naming it and the reason, never a made-up completion.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import posixpath
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import structlog

from forge_kit import errors
from forge_kit.modelref import ModelRef, check_name, check_version
from forge_kit.objectstore import ObjectStore
from forge_kit.validate import check_int, check_path, check_printable_name, check_seed
from forge_model_server.metrics import (
    E2E_LATENCY,
    GENERATION_TOKENS,
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    PROMPT_TOKENS,
    REQUEST_SUCCESS,
)

log = structlog.get_logger(__name__)

FinishReason = Literal["stop", "length", "cancelled"]
ROLES = ("system", "user", "assistant")
#: Most stop strings one request may carry (OpenAI allows 4), and the longest.
MAX_STOPS = 16
MAX_STOP_CHARS = 256
#: Bound of a request's ``priority`` either way (vLLM's lower-runs-first integer).
MAX_PRIORITY = 2**31 - 1
METADATA_FILE = "forge_model.json"
MAX_LOGPROBS = 20
TOKENIZER_FILE = "tokenizer.json"


class ModelNotLoadedError(errors.ConflictError):
    """The model exists in the directory but no engine can serve it (no weights, no torch, …)."""

    def __init__(self, model: str, reason: str) -> None:
        super().__init__(f"no model loaded: {model}: {reason}")
        self.model = model


class ModelNotFoundError(errors.NotFoundError):
    """No folder in the model directory has this name."""

    def __init__(self, model: str, known: list[str]) -> None:
        listing = ", ".join(known) if known else "none"
        super().__init__(f"the model `{model}` does not exist (served models: {listing})")
        self.model = model


@dataclass(frozen=True)
class ModelInfo:
    """A model folder as found in the directory."""

    name: str
    version: str
    path: str
    created: int
    max_context_tokens: int
    weight_files: tuple[str, ...]

    @property
    def id(self) -> str:
        """What clients put in ``model``: the folder name."""
        return self.name


@dataclass(frozen=True)
class ImageInput:
    """An image of a chat message, as received: ``param`` names its part (``messages.0.content.1``)."""

    param: str
    data: bytes
    sha256: str


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    """The text (text parts joined with newlines)."""
    parts: tuple[str | ImageInput, ...] = ()
    """Texts and images in order, when the message holds images (empty otherwise)."""


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability and its most likely alternatives (token text, logprob).

    ``logprob`` is None only for the first prompt token, which has nothing to be scored on.
    """

    token: str
    token_id: int
    logprob: float | None
    top: tuple[tuple[str, float], ...] = ()


@dataclass
class GenerationRequest:
    """One validated generation request; exactly one of ``prompt``, ``messages`` and
    ``prompt_token_ids`` is set."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    priority: int = 0
    logprobs: int | None = None
    """Alternatives to return with each generated token's logprob; None returns no logprobs."""
    prompt_logprobs: int | None = None
    """The same for the prompt tokens (the eval service's log-likelihood scoring)."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token (vLLM's benchmark sets it for fixed lengths)."""
    prompt_token_ids: list[int] | None = None
    """A prompt given as token ids (instead of ``prompt`` or ``messages``)."""
    add_special_tokens: bool = True
    """False: a text prompt without the tokens its tokenizer adds around it (``/tokenize``)."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Token id → bias added to its logit (ids checked against the vocabulary by the engine)."""
    min_tokens: int = 0
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    tokenized: list[int] | None = None
    """The prompt's token ids once :class:`ModelServer` has tokenized it (off the event loop);
    an engine given them does not tokenize again."""
    prepared_images: list[Any] | None = None
    """A vision engine's preprocessed images (pixel values), made with ``tokenized``."""

    @property
    def images(self) -> list[ImageInput]:
        """The images of the messages, in order."""
        parts = (p for m in self.messages or () for p in m.parts)
        return [p for p in parts if isinstance(p, ImageInput)]


@dataclass(frozen=True)
class GenerationChunk:
    """Output since the previous chunk; the last chunk has ``finish_reason`` and the token counts."""

    text: str = ""
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    """Set on the first chunk when asked for: one entry per prompt token (the first unscored)."""
    image_tokens: int = 0
    """Of ``prompt_tokens``, the placeholder positions the images filled (on the last chunk)."""


class Engine(Protocol):
    """Generates text for one loaded model.

    Called by :class:`ModelServer` once per request, from the HTTP routes and the gRPC servicer,
    after the request has been validated. The engine owns the tokenizer (and so the chat template)
    and its scheduling: the continuous-batching engine plugs in here. Closing the returned iterator
    early (client gone, deadline passed) must cancel the request and free what it holds.
    """

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream chunks for ``request``; the last one carries ``finish_reason``. The prompt comes
        tokenized (``request.tokenized``, from :meth:`tokenize` on a worker thread)."""
        ...

    def num_waiting(self) -> int:
        """Requests admitted but not yet running (``vllm:num_requests_waiting``)."""
        ...

    def tokenize(self, request: GenerationRequest) -> list[int]:
        """The token ids ``generate`` would feed the model for ``request``'s prompt or messages
        (chat template applied): what ``/tokenize`` counts. Called off the event loop, one call
        at a time per server."""
        ...


class EngineLoader(Protocol):
    """Builds the engine of a model on its first request; called by :class:`ModelServer` only.

    Raises :class:`ModelNotLoadedError` naming the reason when the model cannot be served.
    """

    def __call__(self, model: ModelInfo) -> Engine: ...


def unavailable_engine_loader(model: ModelInfo) -> Engine:
    """The loader when none is configured (the process passes the real one): says why not."""
    if not model.weight_files:
        raise ModelNotLoadedError(model.name, f"no weights (*.safetensors) in {model.path}")
    missing = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelNotLoadedError(model.name, f"{' and '.join(missing)} not installed in this model server")
    raise ModelNotLoadedError(model.name, "this model server build has no inference engine")


class ModelDirectory:
    """Reads model folders from the object store; every call sees the directory as it is now."""

    def __init__(self, store: ObjectStore) -> None:
        self._store = store

    def _read_json(self, path: str) -> Mapping[str, object]:
        try:
            with self._store.fs.open(path, "rb") as handle:
                data = json.loads(handle.read())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _info(self, folder: str) -> ModelInfo | None:
        name = posixpath.basename(folder.rstrip("/"))
        config_path = f"{folder}/config.json"
        if name.startswith(".") or not self._store.fs.exists(config_path):
            return None
        config = self._read_json(config_path)
        meta = self._read_json(f"{folder}/{METADATA_FILE}")
        files = [str(p) for p in self._store.fs.ls(folder, detail=False)]
        weights = tuple(sorted(posixpath.basename(p) for p in files if p.endswith(".safetensors")))
        context = _context_of(config)
        try:
            created = int(self._store.fs.modified(config_path).timestamp())
        except (NotImplementedError, OSError, AttributeError):
            created = 0
        return ModelInfo(
            name=name,
            version=str(meta.get("version", "")),
            path=self._store.url(name),
            created=created,
            max_context_tokens=context if isinstance(context, int) and context > 0 else 0,
            weight_files=weights,
        )

    def list(self) -> list[ModelInfo]:
        """Every folder with a ``config.json``, sorted by name."""
        entries = self._store.fs.ls(self._store.root, detail=True)
        folders = sorted(str(e["name"]) for e in entries if e.get("type") == "directory")
        return [info for folder in folders if (info := self._info(folder)) is not None]

    def get(self, ref: ModelRef) -> ModelInfo:
        """The model ``ref`` names (its version when pinned); :class:`ModelNotFoundError` otherwise."""
        info = self._info(f"{self._store.root}/{ref.name}")  # a valid name: one folder, never '..'
        if info is not None and (not ref.version or ref.version == info.version):
            return info
        raise ModelNotFoundError(str(ref), [m.name for m in self.list()])


def _context_of(config: Mapping[str, object]) -> object:
    """``max_position_embeddings`` of a config, or of its language model's (a LLaVA's ``text_config``)."""
    text = config.get("text_config")
    return config.get("max_position_embeddings") or (
        text.get("max_position_embeddings") if isinstance(text, dict) else None
    )


def _parsed(model: str) -> ModelRef | None:
    """``model`` as a model reference, or None when it is not one (then no model has that name)."""
    try:
        return ModelRef.parse(model)
    except ValueError:
        return None


def validate(request: GenerationRequest) -> None:
    """Reject what no engine could serve, naming the field (OpenAI names: ``max_tokens``, …)."""
    if not request.model.strip():
        raise errors.ValidationError("model", "is required")
    given = [x is not None for x in (request.prompt, request.messages, request.prompt_token_ids)]
    if not any(given):
        raise errors.ValidationError("prompt", "one of prompt or messages is required")
    if sum(given) > 1:
        raise errors.ValidationError("messages", "give either prompt or messages, not both")
    if request.prompt_token_ids is not None and not request.prompt_token_ids:
        raise errors.ValidationError("prompt", "a token-id prompt must not be empty")
    if request.messages is not None:
        if not request.messages:
            raise errors.ValidationError("messages", "must contain at least one message")
        for i, message in enumerate(request.messages):
            if message.role not in ROLES:
                raise errors.ValidationError(f"messages.{i}.role", f"must be one of {', '.join(ROLES)}")
    if request.max_tokens is not None and request.max_tokens < 1:
        raise errors.ValidationError("max_tokens", f"must be at least 1, got {request.max_tokens}")
    if request.temperature is not None and not (0.0 <= request.temperature <= 2.0):
        raise errors.ValidationError("temperature", f"must be between 0 and 2, got {request.temperature}")
    if request.top_p is not None and not (0.0 < request.top_p <= 1.0 and math.isfinite(request.top_p)):
        raise errors.ValidationError("top_p", f"must be in (0, 1], got {request.top_p}")
    check_printable_name("model", request.model)
    if request.seed is not None:
        check_seed("seed", request.seed)
    check_int("priority", request.priority, -MAX_PRIORITY, MAX_PRIORITY)
    if request.top_k is not None and request.top_k < 0:
        raise errors.ValidationError("top_k", f"must not be negative, got {request.top_k}")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(request, name)
        if value is not None and not (0 <= value <= MAX_LOGPROBS):
            raise errors.ValidationError(name, f"must be between 0 and {MAX_LOGPROBS}, got {value}")
    # Every stop string is looked for after every token: their number and length are bounded.
    if len(request.stop) > MAX_STOPS:
        raise errors.ValidationError(
            "stop", f"must hold at most {MAX_STOPS} strings, got {len(request.stop)}"
        )
    for i, stop in enumerate(request.stop):
        if not stop:
            raise errors.ValidationError(f"stop.{i}", "must not be empty")
        if len(stop) > MAX_STOP_CHARS:
            raise errors.ValidationError(f"stop.{i}", f"must be at most {MAX_STOP_CHARS} characters")


def checkpoint_info(name: str, path: str, version: str | None) -> ModelInfo:
    """The model an admin asks to register, once its name and folder pass the checks; every
    refusal is a :class:`~forge_kit.errors.ValidationError` naming ``name``, ``path`` or ``version``."""
    # The name a model is served under is a model reference's name (no ``:``, which separates a
    # version): the registry's identity of the checkpoint, so an alias that names it routes here.
    for param, value, check in (("name", name, check_name), ("version", version or "", check_version)):
        try:
            check(value)
        except ValueError as exc:
            raise errors.ValidationError(param, str(exc)) from None
    check_path("path", path)
    if "://" in path:
        raise errors.ValidationError(
            "path", f"must be a directory on the model server's disk, not a URL: {path}"
        )
    folder = Path(path)
    if not folder.is_absolute():
        raise errors.ValidationError("path", f"must be absolute: {path}")
    if not folder.is_dir():
        raise errors.ValidationError("path", f"is not a directory: {path}")
    config = folder / "config.json"
    if not config.is_file():
        raise errors.ValidationError("path", f"has no config.json: {path}")
    if not (folder / TOKENIZER_FILE).is_file():
        raise errors.ValidationError("path", f"has no tokenizer ({TOKENIZER_FILE}): {path}")
    weights = tuple(sorted(p.name for p in folder.glob("*.safetensors")))
    if not weights:
        raise errors.ValidationError("path", f"has no weights (*.safetensors): {path}")
    try:
        data = json.loads(config.read_text())
        meta = json.loads((folder / METADATA_FILE).read_text()) if (folder / METADATA_FILE).is_file() else {}
    except (OSError, ValueError) as exc:
        raise errors.ValidationError(
            "path", f"has an unreadable config.json or {METADATA_FILE}: {exc}"
        ) from exc
    context = _context_of(data) if isinstance(data, dict) else None
    return ModelInfo(
        name=name,
        version=version
        if version is not None
        else str(meta.get("version", "") if isinstance(meta, dict) else ""),
        path=str(folder),
        created=int(config.stat().st_mtime),
        max_context_tokens=context if isinstance(context, int) and context > 0 else 0,
        weight_files=weights,
    )


class ModelServer:
    """Lists the models in the directory and those registered at run time, and runs generation on
    their engines."""

    def __init__(
        self,
        directory: ModelDirectory,
        loader: EngineLoader = unavailable_engine_loader,
        *,
        drain_timeout_s: float = 30.0,
    ) -> None:
        self._directory = directory
        self._loader = loader
        self._drain_timeout_s = drain_timeout_s
        self._engines: dict[str, Engine] = {}
        # One thread: HF fast tokenizers are not safe to call from several threads at once.
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._registered: dict[str, ModelInfo] = {}
        self._loading: dict[str, asyncio.Lock] = {}
        self._retiring: set[asyncio.Task[None]] = set()

    def list_models(self) -> list[ModelInfo]:
        """The served models; each gets its metric series so they read 0 before the first request."""
        found = {m.name: m for m in self._directory.list()}
        found.update(self._registered)
        models = [found[name] for name in sorted(found)]
        for model in models:
            NUM_REQUESTS_RUNNING.labels(model.name)
            NUM_REQUESTS_WAITING.labels(model.name)
        return models

    def is_loaded(self, model: ModelInfo) -> bool:
        return model.name in self._engines

    def lookup(self, model: str) -> ModelInfo:
        """The model named ``model`` or ``name:version``, registered ones first; ``model`` is
        parsed here once (a text that is no model reference names no model)."""
        ref = _parsed(model)
        if ref is not None:
            info = self._registered.get(ref.name)
            if info is not None and (not ref.version or ref.version == info.version):
                return info
            try:
                return self._directory.get(ref)
            except ModelNotFoundError:
                pass
        raise ModelNotFoundError(model, [m.name for m in self.list_models()])

    def resolve(self, model: str) -> tuple[ModelInfo, Engine]:
        """The model and its engine, loading the engine on first use (here, on the caller's
        thread: the event loop calls :meth:`load` instead)."""
        info = self.lookup(model)
        engine = self._engines.get(info.name)
        if engine is None:
            engine = self._loader(info)
            self._engines[info.name] = engine
        return info, engine

    async def load(self, model: str) -> tuple[ModelInfo, Engine]:
        """:meth:`resolve` for the event loop: a first load (weights, and the native kernel's build
        on a machine that has not built it, a minute or more on loaded cores) runs on a worker
        thread, one per model at a time, so ``/metrics``, ``/health`` and other models keep
        answering meanwhile."""
        info = self.lookup(model)
        engine = self._engines.get(info.name)
        if engine is not None:
            return info, engine
        lock = self._loading.setdefault(info.name, asyncio.Lock())
        async with lock:
            engine = self._engines.get(info.name)
            if engine is None:
                engine = await asyncio.to_thread(self._loader, info)
                self._engines[info.name] = engine
        return info, engine

    async def preload(self, models: list[str]) -> None:
        """Load ``models`` now (at start-up, before the servers answer), as vLLM loads its model
        before it serves: the first request then pays no load, and a replica that answers its
        health check can serve."""
        for model in models:
            info, _ = await self.load(model)
            log.info("model.preloaded", model=info.id)

    async def register(self, name: str, path: str, version: str | None = None) -> ModelInfo:
        """Admin: serve the Hugging Face folder ``path`` (on this machine) as ``name``.

        1. Check the name and the folder (config, tokenizer, weights): 400 naming the field.
        2. Load the engine now, off the event loop, so a folder that cannot be served is refused
           here (400 naming ``path``, with the reason) instead of on its first request.
        3. Serve it: a model registered under the same name before is replaced; requests already
           on the old engine finish there (it drains in the background).
        """
        # 1. Check.
        info = checkpoint_info(name, path, version)
        if name not in self._registered and name in {m.name for m in self._directory.list()}:
            raise errors.ValidationError("name", f"`{name}` is already a folder of the model directory")
        # 2. Load.
        try:
            engine = await asyncio.to_thread(self._loader, info)
        except ModelNotLoadedError as exc:
            raise errors.ValidationError("path", exc.message) from exc
        # 3. Serve.
        old = self._engines.get(name)
        self._registered[name] = info
        self._engines[name] = engine
        drain = getattr(old, "drain", None)
        if drain is not None:
            task = asyncio.create_task(drain(self._drain_timeout_s), name=f"retire-{name}")
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
        self.list_models()
        return info

    async def generate(self, request: GenerationRequest) -> tuple[ModelInfo, ChunkStream]:
        """Validate, resolve the engine, admit the request, and return the model with its stream.

        Errors a caller can act on (bad field, unknown or unloadable model, full queue) are raised
        here, before the first chunk, so transports can answer with a status instead of a broken
        stream. Closing the stream, started or not, cancels the request in the engine.
        """
        validate(request)
        info, engine = await self.load(request.model)
        images = request.images
        if images and not getattr(engine, "accepts_images", False):
            raise errors.ValidationError(
                images[0].param, f"the model `{info.name}` is text-only: it does not read images"
            )
        if request.tokenized is None:
            request.tokenized = await self._tokenize(engine, request)
        stream = engine.generate(request)
        return info, ChunkStream(self._run(info, engine, stream), stream)

    async def tokenize(self, request: GenerationRequest) -> tuple[ModelInfo, list[int]]:
        """The model and the token ids its engine would see for ``request`` (vLLM's ``/tokenize``):
        how a caller such as the gateway measures a prompt with the serving model's tokenizer."""
        validate(request)
        info, engine = await self.load(request.model)
        return info, await self._tokenize(engine, request)

    async def _tokenize(self, engine: Engine, request: GenerationRequest) -> list[int]:
        """Tokenize on the server's tokenizer thread: a long prompt (megabytes of chat) takes
        seconds, which on the event loop would stall every other request and probe meanwhile."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_thread, engine.tokenize, request)

    async def drain(self, timeout_s: float) -> None:
        """Let every engine finish what it admitted (SIGTERM), refusing new requests meanwhile."""
        for engine in self._engines.values():
            drain = getattr(engine, "drain", None)
            if drain is not None:
                await drain(timeout_s)
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)

    async def _run(
        self, info: ModelInfo, engine: Engine, stream: AsyncIterator[GenerationChunk]
    ) -> AsyncGenerator[GenerationChunk, None]:
        started = time.monotonic()
        running = NUM_REQUESTS_RUNNING.labels(info.name)
        running.inc()
        try:
            async for chunk in stream:
                if chunk.finish_reason is not None:
                    REQUEST_SUCCESS.labels(info.name, chunk.finish_reason).inc()
                    PROMPT_TOKENS.labels(info.name).inc(chunk.prompt_tokens)
                    GENERATION_TOKENS.labels(info.name).inc(chunk.completion_tokens)
                    E2E_LATENCY.labels(info.name).observe(time.monotonic() - started)
                yield chunk
        finally:
            # Closing the engine's stream is how a disconnect or deadline cancels the request there.
            close = getattr(stream, "aclose", None)
            if close is not None:
                await close()
            running.dec()
            NUM_REQUESTS_WAITING.labels(info.name).set(engine.num_waiting())


class ChunkStream:
    """The chunks of one request; ``aclose`` cancels it in the engine even before the first chunk."""

    def __init__(
        self, chunks: AsyncGenerator[GenerationChunk, None], engine_stream: AsyncIterator[GenerationChunk]
    ) -> None:
        self._chunks = chunks
        self._engine_stream = engine_stream

    def __aiter__(self) -> ChunkStream:
        return self

    async def __anext__(self) -> GenerationChunk:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        await self._chunks.aclose()
        close = getattr(self._engine_stream, "aclose", None)
        if close is not None:
            await close()
