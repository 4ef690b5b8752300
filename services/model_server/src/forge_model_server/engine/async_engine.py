"""The live engine: loads a Hugging Face Llama folder and drives :class:`EngineCore` from asyncio.

:class:`AsyncEngine` implements the ``Engine`` seam of ``service.py``. Admission (tokenize, check
the context and the pool, bound the waiting queue) happens when ``generate`` is called, so a
transport answers 400 or 429 before any byte of a stream. One task runs the engine loop; only the
batched forward leaves the event loop (on a worker thread), so scheduler state is only ever touched
from the event loop and an abort between steps cannot race with the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge_kit import errors
from forge_kit.images import MAX_IMAGE_PIXELS, ImageError, open_image
from forge_model_server import metrics, service
from forge_model_server.engine.core import EngineConfig, EngineCore, RequestOutput
from forge_model_server.engine.detokenize import IncrementalDecoder, token_pieces
from forge_model_server.model.kernels import KernelUnavailableError
from forge_model_server.model.llama import DecodeAttention, LlamaModel, UnsupportedModelError
from forge_model_server.model.multimodal import ImageSpan
from forge_model_server.model.vision import VisionEncoder, is_llava, load_llava
from forge_model_server.sample.sampler import Logprob, SamplingParams
from forge_model_server.service import (
    GenerationChunk,
    GenerationRequest,
    ImageInput,
    ModelInfo,
    ModelNotLoadedError,
    TokenLogprob,
)

Clock = Callable[[], float]


def fallback_chat_prompt(messages: list[service.ChatMessage], image_token: str = "") -> str:
    """The chat format of a model whose tokenizer config has no ``chat_template`` (an image part
    is its placeholder token, parts joined with newlines)."""

    def content(m: service.ChatMessage) -> str:
        if not m.parts:
            return m.content
        return "\n".join(image_token if isinstance(p, ImageInput) else p for p in m.parts)

    lines = [f"{m.role}: {content(m)}\n" for m in messages]
    return "".join(lines) + "assistant:"


def _template_message(m: service.ChatMessage) -> dict[str, object]:
    """A message as chat templates take it: an image part is ``{"type": "image"}``."""
    if not m.parts:
        return {"role": m.role, "content": m.content}
    parts = [{"type": "image"} if isinstance(p, ImageInput) else {"type": "text", "text": p} for p in m.parts]
    return {"role": m.role, "content": parts}


@dataclass
class _Tracked:
    queue: asyncio.Queue[RequestOutput | BaseException]
    arrived: float
    prompt_ids: list[int]
    output_text: IncrementalDecoder
    """Each generated token's share of the text (:mod:`.detokenize`), for its logprob entry."""
    last_token: float | None = None
    image_tokens: int = 0


class _RequestStream:
    """Chunks of one admitted request. Unlike an async generator, ``aclose`` before the first
    ``__anext__`` still cancels the request, so a client gone early leaks no blocks."""

    def __init__(self, engine: AsyncEngine, request_id: str, tracked: _Tracked) -> None:
        self._engine = engine
        self._request_id = request_id
        self._tracked = tracked
        self._done = False

    def __aiter__(self) -> _RequestStream:
        return self

    async def __anext__(self) -> GenerationChunk:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._tracked.queue.get()
        except BaseException:
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            await self.aclose()
            raise item
        if item.finish_reason is not None:
            self._done = True
            self._engine._release(self._request_id, finished=True)
        return self._engine._chunk(item, self._tracked)

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._engine._release(self._request_id, finished=False)


class AsyncEngine:
    """One loaded model: tokenizer, chat template, engine core and the loop that steps it."""

    def __init__(
        self,
        name: str,
        core: EngineCore,
        tokenizer: Any,
        *,
        max_model_len: int,
        max_waiting: int,
        clock: Clock = time.monotonic,
        rng: random.Random | None = None,
        vision: VisionEncoder | None = None,
        max_image_pixels: int = MAX_IMAGE_PIXELS,
    ) -> None:
        self.name = name
        self.core = core
        self.vision = vision
        self._max_image_pixels = max_image_pixels
        self._tokenizer = tokenizer
        self._max_model_len = max_model_len
        self._max_waiting = max_waiting
        self._clock = clock
        self._rng = rng or random.Random()
        self._tracked: dict[str, _Tracked] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # Every forward on the same thread: torch's OpenMP team belongs to the thread that calls
        # it, so the default executor's several threads each kept a team of their own (spinning
        # for the cores between steps).
        self._forward_thread = ThreadPoolExecutor(1, thread_name_prefix=f"forward-{name}")
        self._draining = False
        self._last_stats = (0, 0, 0)
        self._ids = itertools.count()

    # -- the Engine seam --------------------------------------------------------------------------

    def num_waiting(self) -> int:
        return len(self.core.waiting)

    @property
    def accepts_images(self) -> bool:
        """Whether this model reads images (a vision-language checkpoint)."""
        return self.vision is not None

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Admit ``request`` now (raising 400/429-class errors) and return its chunk stream."""
        # 1. Tokenize the prompt or the rendered chat.
        field = "messages" if request.messages is not None else "prompt"
        prompt_ids = request.tokenized if request.tokenized is not None else self.tokenize(request)
        vocab = self.core.model.config.vocab_size
        if request.prompt_token_ids is not None and not all(0 <= t < vocab for t in prompt_ids):
            raise errors.ValidationError(field, f"token ids must be in [0, {vocab}) for this model")
        if any(not 0 <= t < vocab for t in request.logit_bias):
            raise errors.ValidationError("logit_bias", f"token ids must be in [0, {vocab}) for this model")
        if not prompt_ids:
            raise errors.ValidationError(field, "is empty after tokenization")
        # 2. Check it fits the context and the KV pool.
        room = self._max_model_len - len(prompt_ids)
        if room < 1:
            raise errors.ValidationError(
                field, f"is {len(prompt_ids)} tokens; this model's context is {self._max_model_len}"
            )
        max_tokens = request.max_tokens or room
        if max_tokens > room:
            raise errors.ValidationError(
                "max_tokens",
                f"{len(prompt_ids)} prompt tokens + {max_tokens} exceed the context of {self._max_model_len}",
            )
        capacity = self.core.config.num_blocks * self.core.config.block_size
        if len(prompt_ids) + max_tokens > capacity:
            raise errors.ValidationError(
                "max_tokens", f"prompt + max_tokens exceed this replica's KV cache of {capacity} tokens"
            )
        # 3. Bound the queue: say so instead of letting latency grow without limit.
        if self._draining:
            raise errors.OverloadedError("the model server is draining; retry on another replica")
        if len(self.core.waiting) >= self._max_waiting:
            raise errors.OverloadedError(
                f"{len(self.core.waiting)} requests are waiting for {self.name}; the queue is full"
            )
        # 4. Hand it to the core and wake the loop.
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=request.top_k or 0,
            stop=tuple(request.stop),
            logprobs=request.logprobs,
            prompt_logprobs=request.prompt_logprobs,
            ignore_eos=request.ignore_eos,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty,
            logit_bias=tuple(sorted(request.logit_bias.items())),
            min_tokens=min(request.min_tokens, max_tokens),
        )
        seed = request.seed if request.seed is not None else self._rng.randrange(2**63)
        # Client ids may repeat; the engine's own id must not.
        engine_id = f"{request.request_id}#{next(self._ids)}"
        images = self._image_spans(request, prompt_ids)
        self.core.add_request(
            engine_id, prompt_ids, params, seed=seed, priority=request.priority, images=images
        )
        tracked = _Tracked(
            asyncio.Queue(),
            self._clock(),
            prompt_ids,
            IncrementalDecoder(self._decode),
            image_tokens=sum(i.length for i in images),
        )
        self._tracked[engine_id] = tracked
        self._ensure_loop()
        self._wake.set()
        metrics.NUM_REQUESTS_WAITING.labels(self.name).set(len(self.core.waiting))
        return self._stream(engine_id, tracked)

    def tokenize(self, request: GenerationRequest) -> list[int]:
        """The prompt ids :meth:`generate` would admit for ``request`` (the same template and call).
        With images: each ``<image>`` token of the rendered chat becomes ``image_seq_length``
        placeholders, and the images are decoded and preprocessed (``request.prepared_images``),
        here on the tokenizer thread; a corrupt, oversized or unsupported one is a 400 naming it."""
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        ids = list(
            self._tokenizer.encode(self._prompt_text(request), add_special_tokens=request.add_special_tokens)
        )
        if self.vision is None:
            return ids
        images = request.images
        layout = self.vision.layout
        found = ids.count(layout.image_token_id)
        if found != len(images):
            raise errors.ValidationError(
                "messages" if request.messages is not None else "prompt",
                f"the prompt holds {found} image placeholders for {len(images)} images",
            )
        request.prepared_images = [self._pixels(image) for image in images]
        expanded: list[int] = []
        for token in ids:
            expanded += [token] * (layout.image_seq_length if token == layout.image_token_id else 1)
        return expanded

    def _pixels(self, image: ImageInput) -> Any:
        assert self.vision is not None
        try:
            decoded = open_image(image.data, max_pixels=self._max_image_pixels)
        except ImageError as exc:
            raise errors.ValidationError(image.param, f"the image {exc}") from None
        return self.vision.preprocess(decoded)

    def _image_spans(self, request: GenerationRequest, prompt_ids: list[int]) -> list[ImageSpan]:
        """Where each preprocessed image sits in the prompt: its runs of placeholder tokens."""
        images = request.images
        if self.vision is None:
            return []
        layout = self.vision.layout
        placeholders = prompt_ids.count(layout.image_token_id)
        if placeholders != len(images) * layout.image_seq_length:
            field = "messages" if request.messages is not None else "prompt"
            raise errors.ValidationError(
                field,
                f"holds {placeholders} image placeholder tokens; {len(images)} images fill "
                f"{len(images) * layout.image_seq_length}",
            )
        if not images:
            return []
        if request.prepared_images is None:  # tokenized elsewhere: preprocess now
            request.prepared_images = [self._pixels(image) for image in images]
        spans, at = [], 0
        for image, pixels in zip(images, request.prepared_images, strict=True):
            at = prompt_ids.index(layout.image_token_id, at)
            spans.append(ImageSpan(at, layout.image_seq_length, image.sha256, pixels))
            at += layout.image_seq_length
        return spans

    def _prompt_text(self, request: GenerationRequest) -> str:
        if request.messages is None:
            return request.prompt or ""
        if getattr(self._tokenizer, "chat_template", None):
            rendered = self._tokenizer.apply_chat_template(
                [_template_message(m) for m in request.messages],
                tokenize=False,
                add_generation_prompt=True,
            )
            return str(rendered)
        token = ""
        if self.vision is not None:
            token = str(self._tokenizer.convert_ids_to_tokens(self.vision.layout.image_token_id))
        return fallback_chat_prompt(request.messages, token)

    def _stream(self, request_id: str, tracked: _Tracked) -> _RequestStream:
        return _RequestStream(self, request_id, tracked)

    def _release(self, request_id: str, finished: bool) -> None:
        """The stream is done with: forget it, and cancel it in the core if it did not finish."""
        self._tracked.pop(request_id, None)
        if not finished:
            self.core.abort(request_id)
            metrics.NUM_REQUESTS_WAITING.labels(self.name).set(len(self.core.waiting))
            metrics.KV_CACHE_USAGE.labels(self.name).set(self.core.pool.usage())

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids))

    def detokenize(self, ids: list[int]) -> str:
        """The text of ``ids`` (vLLM's ``/detokenize``), special tokens included."""
        vocab = self.core.model.config.vocab_size
        if not all(0 <= t < vocab for t in ids):
            raise errors.ValidationError("tokens", f"token ids must be in [0, {vocab}) for this model")
        return self._decode(ids)

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's ``/tokenizer_info``: the special tokens, the chat template and the context (no
        ``name_or_path``: the checkpoint's place on this host stays here)."""
        tok = self._tokenizer
        return {
            "tokenizer_class": type(tok).__name__,
            "eos_token": tok.eos_token,
            "bos_token": tok.bos_token,
            "pad_token": tok.pad_token,
            "unk_token": tok.unk_token,
            "chat_template": getattr(tok, "chat_template", None),
            "model_max_length": self._max_model_len,
            "vocab_size": self.core.model.config.vocab_size,
        }

    def _chunk(self, out: RequestOutput, tracked: _Tracked) -> GenerationChunk:
        """The chunk of one step's output. Each logprob entry's ``token`` is that token's share of
        the decoded text (:mod:`.detokenize`): pieces join to the text, so offsets counted from
        them are character offsets even where one character spans several byte tokens."""
        prompt_lps = None
        if out.prompt_logprobs is not None:
            pieces = token_pieces(self._decode, tracked.prompt_ids)
            prompt_lps = tuple(
                TokenLogprob(piece, token_id, None) if lp is None else self._token_logprob(lp, piece)
                for lp, piece, token_id in zip(out.prompt_logprobs, pieces, tracked.prompt_ids, strict=True)
            )
        texts = [tracked.output_text.push(lp.token_id) for lp in out.logprobs]
        if texts and out.finish_reason is not None:
            texts[-1] += tracked.output_text.flush()
        return GenerationChunk(
            text=out.text,
            token_ids=out.token_ids,
            finish_reason=out.finish_reason,  # type: ignore[arg-type]
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            logprobs=tuple(
                self._token_logprob(lp, text) for lp, text in zip(out.logprobs, texts, strict=True)
            ),
            prompt_logprobs=prompt_lps,
            image_tokens=tracked.image_tokens if out.finish_reason is not None else 0,
        )

    def _token_logprob(self, lp: Logprob, text: str) -> TokenLogprob:
        """``lp`` with ``text``, its token's share of the decoded text; the alternatives decoded
        alone (as vLLM gives them)."""
        return TokenLogprob(
            token=text,
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=tuple((self._decode([t]), v) for t, v in lp.top),
        )

    # -- the loop ---------------------------------------------------------------------------------

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name=f"engine-{self.name}")

    async def _loop(self) -> None:
        """1. wait for work  2. schedule  3. forward on a thread  4. deliver outputs  5. metrics."""
        try:
            while True:
                # 1. Sleep until a request arrives.
                if not self.core.has_work():
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                # 2. Schedule on the event loop, where adds and aborts also happen.
                batch = self.core.schedule()
                if not batch.seqs:
                    await asyncio.sleep(0.001)
                    continue
                inputs = self.core.prepare(batch)
                # 3. One batched forward; the HTTP server keeps serving meanwhile.
                logits = await asyncio.get_running_loop().run_in_executor(
                    self._forward_thread, self.core.execute, inputs
                )
                # 4. Sample, stop, free, and hand each request its output.
                now = self._clock()
                for out in self.core.update(batch, inputs, logits):
                    tracked = self._tracked.get(out.request_id)
                    if tracked is None:
                        continue
                    if tracked.last_token is None:
                        metrics.TIME_TO_FIRST_TOKEN.labels(self.name).observe(now - tracked.arrived)
                    else:
                        metrics.INTER_TOKEN_LATENCY.labels(self.name).observe(now - tracked.last_token)
                    tracked.last_token = now
                    tracked.queue.put_nowait(out)
                # 5. Gauges and counters in vLLM's names.
                self._publish_metrics()
        except Exception as exc:  # a broken model fails its requests, never silently hangs them
            for request_id, tracked in list(self._tracked.items()):
                self.core.abort(request_id)
                tracked.queue.put_nowait(exc)
            raise

    def _publish_metrics(self) -> None:
        stats = self.core.stats
        preemptions, queries, hits = self._last_stats
        metrics.NUM_PREEMPTIONS.labels(self.name).inc(stats.num_preemptions - preemptions)
        metrics.PREFIX_CACHE_QUERIES.labels(self.name).inc(stats.prefix_queries - queries)
        metrics.PREFIX_CACHE_HITS.labels(self.name).inc(stats.prefix_hits - hits)
        self._last_stats = (stats.num_preemptions, stats.prefix_queries, stats.prefix_hits)
        metrics.NUM_REQUESTS_WAITING.labels(self.name).set(len(self.core.waiting))
        metrics.KV_CACHE_USAGE.labels(self.name).set(self.core.pool.usage())

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests, let admitted ones finish within ``timeout_s``, then stop the loop."""
        self._draining = True
        deadline = self._clock() + timeout_s
        while self.core.has_work() and self._clock() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self._tracked):
            self.core.abort(request_id)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._forward_thread.shutdown(wait=False)


class HFEngineLoader:
    """The ``EngineLoader`` of this build: a Hugging Face Llama folder → :class:`AsyncEngine`."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        max_waiting: int,
        clock: Clock = time.monotonic,
        rng: random.Random | None = None,
        decode_attention: DecodeAttention = "auto",
        max_image_pixels: int = MAX_IMAGE_PIXELS,
    ) -> None:
        self._config = config
        self._decode_attention = decode_attention
        self._max_image_pixels = max_image_pixels
        self._max_waiting = max_waiting
        self._clock = clock
        self._rng = rng or random.Random()

    def __call__(self, model: ModelInfo) -> AsyncEngine:
        if not model.weight_files:
            raise ModelNotLoadedError(model.name, f"no weights (*.safetensors) in {model.path}")
        if "://" in model.path:
            raise ModelNotLoadedError(
                model.name, f"only local model directories can be loaded, not {model.path}"
            )
        folder = Path(model.path)
        try:
            from transformers import PreTrainedTokenizerFast

            sizes = {"num_blocks": self._config.num_blocks, "block_size": self._config.block_size}
            vision: VisionEncoder | None = None
            if is_llava(json.loads((folder / "config.json").read_text())):
                llama, vision = load_llava(folder, **sizes, decode_attention=self._decode_attention)
            else:
                llama = LlamaModel.load(folder, **sizes, decode_attention=self._decode_attention)
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder))
        except (
            UnsupportedModelError,
            KernelUnavailableError,
            OSError,
            ValueError,
            KeyError,
            TypeError,
            AttributeError,
        ) as exc:
            raise ModelNotLoadedError(model.name, f"cannot load {folder}: {exc}") from exc
        eos = set(llama.config.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        core = EngineCore(
            llama,
            self._config,
            lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)),
            tuple(sorted(eos)),
            encode=vision.encode if vision is not None else None,
        )
        return AsyncEngine(
            model.name,
            core,
            tokenizer,
            max_model_len=llama.config.max_position_embeddings,
            max_waiting=self._max_waiting,
            clock=self._clock,
            rng=self._rng,
            vision=vision,
            max_image_pixels=self._max_image_pixels,
        )
