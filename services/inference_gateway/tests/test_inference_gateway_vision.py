"""Images through the gateway with the official ``openai`` SDK, in front of a real model_server
process serving a tiny random LLaVA and a text-only Llama: ``image_url`` parts reach the model (a
~1.5 MB image fits the body limits), the answer is the model server's own, the usage counts the
image's tokens (relayed, and metered in ``forge_gateway_tokens_total``), and the model server's
refusals (an image for a text-only model, a corrupt image) come back as 400s naming the part."""

from __future__ import annotations

import base64
import io
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from PIL import Image
from prometheus_client import REGISTRY

from forge_inference_gateway.config import InferenceGatewaySettings
from forge_inference_gateway.openai_api import install_gateway_api
from forge_inference_gateway.service import InferenceGateway
from forge_kit.db import Database
from forge_kit.http import HttpServer, make_app
from forge_kit.testing import ServiceProcess, base_env
from forge_kit.testing.tiny_llama import save_tiny_llama
from forge_kit.testing.tiny_llava import save_tiny_llava

from .conftest import ADMIN_TOKEN, API_KEY, build_gateway

pytestmark = pytest.mark.integration
UPSTREAM_TOKEN = "upstream-token"


def _png_uri(seed: int, side: int) -> str:
    pixels = np.random.RandomState(seed).randint(0, 256, (side, side, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _chat(url: str) -> list[Any]:
    return [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What?"}],
        }
    ]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vision") / "models"
    save_tiny_llava(root / "llava")
    save_tiny_llama(root / "text-only")
    return root


@pytest.fixture(scope="module")
def model_server(models: Path) -> Iterator[ServiceProcess]:
    env = base_env("model_server", token=UPSTREAM_TOKEN, models_dir=str(models), torch_threads="1")
    root = models.parent
    proc = ServiceProcess("forge_model_server", env=env, cwd=str(root), log_path=str(root / "log")).start(60)
    yield proc
    proc.stop()


@pytest.fixture
async def gateway(model_server: ServiceProcess, db: Database) -> AsyncIterator[InferenceGateway]:
    service = build_gateway(db, [model_server.http_url], request_timeout_s=60)
    await service.tenants.bootstrap(API_KEY)
    yield service
    await service.replicas.stop()


@pytest.fixture
async def clients(
    gateway: InferenceGateway, model_server: ServiceProcess
) -> AsyncIterator[tuple[openai.AsyncOpenAI, openai.AsyncOpenAI]]:
    app = make_app("inference_gateway")
    install_gateway_api(app, gateway, ADMIN_TOKEN)
    # The body limit the gateway process takes from its settings (the OpenAI servers' default).
    server = HttpServer(app, "127.0.0.1", 0, max_body_bytes=InferenceGatewaySettings().http_max_body_bytes)
    await server.start()
    through = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1", api_key=API_KEY, max_retries=0, timeout=120
    )
    direct = openai.AsyncOpenAI(
        base_url=f"{model_server.http_url}/v1", api_key=UPSTREAM_TOKEN, max_retries=0, timeout=120
    )
    async with through, direct:
        yield through, direct
    await server.stop()


def _image_tokens_metered() -> float:
    return sum(
        sample.value
        for metric in REGISTRY.collect()
        if metric.name == "forge_gateway_tokens"
        for sample in metric.samples
        if sample.name == "forge_gateway_tokens_total" and sample.labels.get("kind") == "image"
    )


async def test_an_image_chat_goes_through_with_its_usage(
    clients: tuple[openai.AsyncOpenAI, openai.AsyncOpenAI],
) -> None:
    through, direct = clients
    big = _png_uri(0, 700)  # ~1.5 MB of PNG, ~2 MB as base64
    assert 1 << 20 < len(big) < 4 << 20
    before = _image_tokens_metered()
    reply = await through.chat.completions.create(
        model="llava", messages=_chat(big), max_tokens=6, temperature=0
    )
    same = await direct.chat.completions.create(
        model="llava", messages=_chat(big), max_tokens=6, temperature=0
    )
    assert reply.choices[0].message.content == same.choices[0].message.content
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.model_dump().get("image_tokens") == 16
    assert same.usage is not None and usage.prompt_tokens == same.usage.prompt_tokens > 16
    assert _image_tokens_metered() - before == 16
    # Streamed, with usage: the same answer, metered too.
    stream = await through.chat.completions.create(
        model="llava",
        messages=_chat(big),
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == reply.choices[0].message.content
    )
    assert _image_tokens_metered() - before == 32


async def test_model_server_refusals_come_back_naming_the_part(
    clients: tuple[openai.AsyncOpenAI, openai.AsyncOpenAI],
) -> None:
    through, _ = clients
    small = _png_uri(1, 20)
    with pytest.raises(openai.BadRequestError) as text_only:
        await through.chat.completions.create(model="text-only", messages=_chat(small), max_tokens=2)
    assert text_only.value.param == "messages.0.content.0" and "text-only" in text_only.value.message
    corrupt = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nbroken").decode()
    with pytest.raises(openai.BadRequestError) as bad:
        await through.chat.completions.create(model="llava", messages=_chat(corrupt), max_tokens=2)
    assert bad.value.param == "messages.0.content.0"
    with pytest.raises(openai.BadRequestError) as form:  # refused by the gateway itself
        await through.chat.completions.create(
            model="llava", messages=_chat("file:///etc/passwd"), max_tokens=2
        )
    assert form.value.param == "messages.0.content.0"
    with pytest.raises(openai.BadRequestError) as fetch:  # URLs: off by default on the model server
        await through.chat.completions.create(
            model="llava", messages=_chat("http://169.254.169.254/latest/meta-data"), max_tokens=2
        )
    assert fetch.value.param == "messages.0.content.0" and "not fetched" in fetch.value.message
