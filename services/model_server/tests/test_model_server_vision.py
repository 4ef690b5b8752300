"""Images through the model server, as an OpenAI client sends them: a live tiny random LLaVA
(CLIP tower + projector + Llama) served by uvicorn, called with the ``openai`` SDK's ``image_url``
parts. The reference is transformers' own ``LlavaForConditionalGeneration.generate`` on the same
folder: the server's greedy tokens must be the same, alone, batched with other images, and with the
image cut in two by chunked prefill. Bad images are 400s naming the part, and lose nothing else."""

from __future__ import annotations

import asyncio
import base64
import io
import shutil
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch
from fastapi import FastAPI
from fastapi.responses import RedirectResponse, Response
from PIL import Image

from forge_kit.http import HttpServer, make_app
from forge_kit.objectstore import ObjectStore
from forge_kit.testing.tiny_llava import save_tiny_llava
from forge_model_server.engine.async_engine import AsyncEngine, HFEngineLoader
from forge_model_server.engine.core import EngineConfig
from forge_model_server.entrypoints.image_inputs import ImagePolicy
from forge_model_server.entrypoints.openai_api import install_openai_api
from forge_model_server.entrypoints.safe_fetch import parse_networks
from forge_model_server.service import ModelDirectory, ModelServer

TOKEN = "vision-token"
QUESTION = "To be, or not to be?"


def _image(seed: int, size: tuple[int, int] = (40, 48)) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


def _data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _chat(url: str, text: str = QUESTION) -> list[Any]:
    return [
        {
            "role": "user",
            "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}],
        }
    ]


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llava(tmp_path_factory.mktemp("llava") / "tiny-llava")


@pytest.fixture(scope="module")
def reference(llava: Path) -> Any:
    """transformers' LLaVA and image processor on the same folder."""
    from transformers import AutoImageProcessor, LlavaForConditionalGeneration, PreTrainedTokenizerFast

    model = LlavaForConditionalGeneration.from_pretrained(str(llava)).eval()
    return (
        model,
        AutoImageProcessor.from_pretrained(str(llava)),
        PreTrainedTokenizerFast.from_pretrained(str(llava)),
    )


def _hf_greedy(reference: Any, image: Image.Image, text: str, max_new_tokens: int) -> list[int]:
    model, processor, tokenizer = reference
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tokenizer.encode(prompt)
    expanded = [
        t
        for i in ids
        for t in ([i] * model.config.image_seq_length if i == model.config.image_token_id else [i])
    ]
    pixels = processor(images=[image.convert("RGB")], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([expanded]),
            pixel_values=pixels,
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return [int(t) for t in out[0, len(expanded) :]]


async def _serve(
    models: Path,
    *,
    policy: ImagePolicy | None = None,
    engine: EngineConfig | None = None,
    max_pixels: int = 1 << 24,
) -> tuple[HttpServer, ModelServer]:
    loader = HFEngineLoader(
        engine or EngineConfig(num_blocks=64, block_size=8), max_waiting=16, max_image_pixels=max_pixels
    )
    server = ModelServer(ModelDirectory(ObjectStore(str(models))), loader=loader)
    app = make_app("model_server")
    install_openai_api(app, server, TOKEN, policy)
    http = HttpServer(app, "127.0.0.1", 0)
    await http.start()
    return http, server


@pytest.fixture
def models(tmp_path: Path, llava: Path, tiny_llama: Path) -> Path:
    shutil.copytree(llava, tmp_path / "models" / "llava")
    shutil.copytree(tiny_llama, tmp_path / "models" / "text-only")
    return tmp_path / "models"


@pytest.fixture
async def served(models: Path) -> AsyncIterator[tuple[openai.AsyncOpenAI, ModelServer]]:
    http, server = await _serve(models, policy=ImagePolicy(max_bytes=64 << 10))
    url = f"http://127.0.0.1:{http.port}/v1"
    async with openai.AsyncOpenAI(base_url=url, api_key=TOKEN, max_retries=0, timeout=120) as sdk:
        yield sdk, server
    await server.drain(0)
    await http.stop()


def _tokens(tokenizer: Any, text: str | None) -> list[int]:
    return [int(t) for t in tokenizer.encode(text or "")]


async def test_greedy_output_equals_transformers_generate_batched(
    served: tuple[openai.AsyncOpenAI, ModelServer], reference: Any
) -> None:
    client, server = served
    images = [_image(seed) for seed in range(3)]
    # Three requests at once (different images, same text) share engine steps.
    replies = await asyncio.gather(
        *(
            client.chat.completions.create(
                model="llava", messages=_chat(_data_uri(_encoded(im))), max_tokens=8, temperature=0
            )
            for im in images
        )
    )
    tokenizer = reference[2]
    expected = [_hf_greedy(reference, im, QUESTION, 8) for im in images]
    got = [_tokens(tokenizer, r.choices[0].message.content) for r in replies]
    for reply, want in zip(replies, expected, strict=True):
        assert reply.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True)
    assert len({tuple(g) for g in got}) > 1, "different images must change the answer"
    usage = replies[0].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    image_tokens = reference[0].config.image_seq_length
    assert usage.prompt_tokens_details.model_dump().get("image_tokens") == image_tokens
    assert usage.prompt_tokens > image_tokens
    # The same text with a new image never reuses the cached blocks of the earlier images (the
    # text-only first block is shared); the same image again reuses its own.
    engine = server._engines["llava"]
    assert isinstance(engine, AsyncEngine)
    hits = engine.core.stats.prefix_hits
    new = _image(99)
    other = await client.chat.completions.create(
        model="llava", messages=_chat(_data_uri(_encoded(new))), max_tokens=8, temperature=0
    )
    assert other.choices[0].message.content == tokenizer.decode(
        _hf_greedy(reference, new, QUESTION, 8), skip_special_tokens=True
    )
    block = engine.core.config.block_size
    assert engine.core.stats.prefix_hits - hits < 2 * block  # at most the text before the image
    hits = engine.core.stats.prefix_hits
    again = await client.chat.completions.create(
        model="llava", messages=_chat(_data_uri(_encoded(images[0]))), max_tokens=8, temperature=0
    )
    assert again.choices[0].message.content == replies[0].choices[0].message.content
    assert engine.core.stats.prefix_hits - hits >= 2 * block  # the image's blocks are reused


async def test_image_cut_by_chunked_prefill_and_streamed(models: Path, reference: Any) -> None:
    """A token budget of 10 splits the 16 placeholders over several steps; the answer is the same."""
    http, server = await _serve(
        models,
        engine=EngineConfig(
            num_blocks=64, block_size=4, max_num_batched_tokens=10, enable_prefix_caching=False
        ),
    )
    try:
        async with openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{http.port}/v1", api_key=TOKEN, max_retries=0, timeout=120
        ) as client:
            image = _image(7, (64, 32))
            stream = await client.chat.completions.create(
                model="llava",
                messages=_chat(_data_uri(_encoded(image, "JPEG"), "image/jpeg")),
                max_tokens=6,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [c async for c in stream]
    finally:
        await server.drain(0)
        await http.stop()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    decoded = Image.open(io.BytesIO(_encoded(image, "JPEG")))
    assert text == reference[2].decode(_hf_greedy(reference, decoded, QUESTION, 6), skip_special_tokens=True)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


@pytest.mark.parametrize(
    ("url", "message"),
    [
        (_data_uri(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64), "supported format"),
        (_data_uri(_encoded(_image(1))[:200]), "corrupt"),
        (_data_uri(_encoded(_image(1), "BMP"), "image/bmp"), "supported format"),
        ("data:image/png;base64,!!!notbase64", "base64"),
        (_data_uri(_encoded(_image(2, (400, 400)))), "bytes"),
        (_data_uri(_encoded(Image.new("RGB", (1200, 1200)))), "pixels"),
        ("data:text/plain;base64,aGVsbG8=", "image"),
        ("http://example.com/cat.png", "not fetched"),
        ("ftp://example.com/cat.png", "http(s)"),
    ],
)
async def test_bad_images_are_400_naming_the_part_and_lose_nothing(
    models: Path, reference: Any, url: str, message: str
) -> None:
    http, server = await _serve(models, policy=ImagePolicy(max_bytes=64 << 10), max_pixels=1 << 20)
    try:
        async with openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{http.port}/v1", api_key=TOKEN, max_retries=0, timeout=120
        ) as client:
            good = _image(3)
            bad_call = client.chat.completions.create(
                model="llava", messages=_chat(url), max_tokens=4, temperature=0
            )
            good_call = client.chat.completions.create(
                model="llava", messages=_chat(_data_uri(_encoded(good))), max_tokens=4, temperature=0
            )
            bad, ok = await asyncio.gather(bad_call, good_call, return_exceptions=True)
    finally:
        await server.drain(0)
        await http.stop()
    assert isinstance(bad, openai.BadRequestError), bad
    assert bad.param == "messages.0.content.1" and message in bad.message, bad.message
    assert not isinstance(ok, BaseException)
    assert ok.choices[0].message.content == reference[2].decode(
        _hf_greedy(reference, good, QUESTION, 4), skip_special_tokens=True
    )


async def test_text_only_model_and_placeholder_mismatch_are_refused(
    served: tuple[openai.AsyncOpenAI, ModelServer],
) -> None:
    client, _ = served
    uri = _data_uri(_encoded(_image(4)))
    with pytest.raises(openai.BadRequestError) as text_only:
        await client.chat.completions.create(model="text-only", messages=_chat(uri), max_tokens=4)
    assert text_only.value.param == "messages.0.content.1" and "text-only" in text_only.value.message
    # "<image>" typed as text is a placeholder with no image: refused, never fed as noise.
    with pytest.raises(openai.BadRequestError) as typed:
        await client.chat.completions.create(
            model="llava", messages=[{"role": "user", "content": "look: <image>"}], max_tokens=4
        )
    assert typed.value.param == "messages" and "placeholder" in typed.value.message
    with pytest.raises(openai.BadRequestError) as completion:  # the same through /v1/completions
        await client.completions.create(model="llava", prompt="look: <image>", max_tokens=4)
    assert completion.value.param == "prompt" and "placeholder" in completion.value.message
    # Text-only chats still work on the vision model.
    plain = await client.chat.completions.create(
        model="llava", messages=[{"role": "user", "content": QUESTION}], max_tokens=4, temperature=0
    )
    assert plain.usage is not None and plain.usage.prompt_tokens_details is None


def _image_host(png: bytes) -> FastAPI:
    app = FastAPI()

    @app.get("/cat.png")
    async def cat() -> Response:
        return Response(png, media_type="image/png")

    @app.get("/big.png")
    async def big() -> Response:
        return Response(b"\x00" * (80 << 10), media_type="image/png")

    @app.get("/same-host")
    async def same_host() -> RedirectResponse:
        return RedirectResponse("/cat.png")

    @app.get("/elsewhere")
    async def elsewhere() -> RedirectResponse:
        return RedirectResponse("http://localhost:1/cat.png")

    return app


async def test_image_urls_fetched_only_when_allowed_and_never_internal(models: Path, reference: Any) -> None:
    image = _image(5)
    host = HttpServer(_image_host(_encoded(image)), "127.0.0.1", 0)
    await host.start()
    base = f"http://127.0.0.1:{host.port}"
    refusing = await _serve(models, policy=ImagePolicy(fetch_urls=True, max_bytes=64 << 10))
    allowing = await _serve(
        models,
        policy=ImagePolicy(
            fetch_urls=True, max_bytes=64 << 10, allowed_networks=parse_networks(["127.0.0.1/32"])
        ),
    )
    try:
        # Fetching on, but loopback is internal: refused (nor metadata or private addresses).
        async with openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{refusing[0].port}/v1", api_key=TOKEN, max_retries=0, timeout=120
        ) as client:
            for url in (
                f"{base}/cat.png",
                "http://169.254.169.254/latest/meta-data",
                "http://10.0.0.1/x.png",
            ):
                with pytest.raises(openai.BadRequestError) as internal:
                    await client.chat.completions.create(model="llava", messages=_chat(url), max_tokens=2)
                assert internal.value.param == "messages.0.content.1" and "internal" in internal.value.message
        # An operator's allow-list lets 127.0.0.1 through; redirects stay on the host; size bounded.
        async with openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{allowing[0].port}/v1", api_key=TOKEN, max_retries=0, timeout=120
        ) as client:
            want = reference[2].decode(_hf_greedy(reference, image, QUESTION, 4), skip_special_tokens=True)
            for path in ("/cat.png", "/same-host"):
                reply = await client.chat.completions.create(
                    model="llava", messages=_chat(base + path), max_tokens=4, temperature=0
                )
                assert reply.choices[0].message.content == want
            for path, why in (("/elsewhere", "another host"), ("/big.png", "bytes"), ("/missing.png", "404")):
                with pytest.raises(openai.BadRequestError) as refused:
                    await client.chat.completions.create(
                        model="llava", messages=_chat(base + path), max_tokens=2
                    )
                assert why in refused.value.message, refused.value.message
    finally:
        for http, server in (refusing, allowing):
            await server.drain(0)
            await http.stop()
        await host.stop()


async def test_preempted_image_requests_are_recomputed_from_their_pixels(
    models: Path, reference: Any
) -> None:
    """A pool too small for three image requests at once: some are preempted (their image
    embeddings dropped with their blocks) and recomputed later; every answer is still the one
    transformers gives."""
    http, server = await _serve(
        models, engine=EngineConfig(num_blocks=20, block_size=4, max_num_batched_tokens=64)
    )
    try:
        # Load the model, then hold its first forward until all three requests are in: on a busy
        # machine one request could otherwise finish before the next arrives, and nothing would
        # compete for the pool.
        _, engine = await server.load("llava")
        assert isinstance(engine, AsyncEngine)
        execute, admitted = engine.core.execute, threading.Event()

        def held_execute(inputs: Any) -> Any:
            assert admitted.wait(60), "three requests were not admitted within 60 s"
            return execute(inputs)

        engine.core.execute = held_execute  # type: ignore[method-assign]

        async def admit_all() -> None:
            while len(engine.core.waiting) + len(engine.core.running) < 3:
                await asyncio.sleep(0.01)
            admitted.set()

        watcher = asyncio.create_task(admit_all())
        async with openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{http.port}/v1", api_key=TOKEN, max_retries=0, timeout=120
        ) as client:
            images = [_image(20 + i) for i in range(3)]
            replies = await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model="llava", messages=_chat(_data_uri(_encoded(im))), max_tokens=8, temperature=0
                    )
                    for im in images
                )
            )
            await watcher
            preemptions = engine.core.stats.num_preemptions
    finally:
        await server.drain(0)
        await http.stop()
    tokenizer = reference[2]
    for reply, image in zip(replies, images, strict=True):
        want = tokenizer.decode(_hf_greedy(reference, image, QUESTION, 8), skip_special_tokens=True)
        assert reply.choices[0].message.content == want
    assert preemptions > 0


def test_a_llava_folder_without_its_image_processor_is_refused_naming_it(llava: Path, tmp_path: Path) -> None:
    from forge_model_server.service import ModelInfo, ModelNotLoadedError

    folder = tmp_path / "no-processor"
    shutil.copytree(llava, folder)
    (folder / "preprocessor_config.json").unlink()
    loader = HFEngineLoader(EngineConfig(num_blocks=8, block_size=8), max_waiting=1)
    with pytest.raises(ModelNotLoadedError, match=r"preprocessor_config\.json"):
        loader(ModelInfo("no-processor", "", str(folder), 0, 0, ("model.safetensors",)))


def test_one_step_encodes_every_new_image_in_one_batch(llava: Path, reference: Any) -> None:
    """Three image requests admitted together: their first step runs the vision tower once, on
    all three images, and each prompt's placeholders get its own image (greedy = transformers)."""
    from forge_kit.images import ImageBytes
    from forge_model_server.sample.sampler import SamplingParams
    from forge_model_server.service import ChatMessage, GenerationRequest, ImageInput, ModelInfo

    engine = HFEngineLoader(EngineConfig(num_blocks=64, block_size=8), max_waiting=8)(
        ModelInfo("llava", "", str(llava), 0, 0, ("model.safetensors",))
    )
    core = engine.core
    assert core.encode is not None
    encode, batches = core.encode, []

    def recording(pixels: list[torch.Tensor]) -> list[torch.Tensor]:
        batches.append(len(pixels))
        return encode(pixels)

    core.encode = recording
    images = [_image(40 + i) for i in range(3)]
    for i, image in enumerate(images):
        data = ImageBytes.of(_encoded(image))
        part = ImageInput("messages.0.content.1", data.data, data.sha256)
        request = GenerationRequest(model="llava", messages=[ChatMessage("user", QUESTION, (QUESTION, part))])
        ids = engine.tokenize(request)
        spans = engine._image_spans(request, ids)
        core.add_request(f"r{i}", ids, SamplingParams(max_tokens=6, temperature=0.0), seed=0, images=spans)
    produced: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    while core.has_work():
        for out in core.step():
            produced[out.request_id] += out.token_ids
    assert batches == [3]
    for i, image in enumerate(images):
        assert produced[f"r{i}"] == _hf_greedy(reference, image, QUESTION, 6)
