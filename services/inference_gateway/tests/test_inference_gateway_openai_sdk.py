"""The gateway through the official ``openai`` SDK, in front of a real model_server process serving
a tiny Llama: what an OpenAI client sends goes through routing to the engine and back, sampling
parameters included, and every error arrives as the SDK's exception class."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from transformers import PreTrainedTokenizerFast

from forge_inference_gateway.openai_api import install_gateway_api
from forge_inference_gateway.service import InferenceGateway
from forge_kit.db import Database
from forge_kit.http import HttpServer, make_app
from forge_kit.testing import ServiceProcess
from forge_kit.testing.tiny_llama import save_tiny_llama

from .conftest import ADMIN_TOKEN, API_KEY, build_gateway

pytestmark = pytest.mark.integration
UPSTREAM_TOKEN = "upstream-token"
PROMPT = "To be, or not to be, to be, or not to be, to be"
CORPUS = (
    "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer "
    "the slings and arrows of outrageous fortune, or to take arms against a sea of troubles."
)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Weights drawn wide so greedy choices are no near-ties, and a greedy continuation of
    # PROMPT that repeats itself (so a presence penalty has something to change).
    folder = tmp_path_factory.mktemp("tiny") / "models" / "tiny"
    return save_tiny_llama(folder, corpus=[CORPUS] * 4, initializer_range=0.2)


@pytest.fixture(scope="module")
def model_server(tiny_folder: Path) -> Iterator[ServiceProcess]:
    root = tiny_folder.parent.parent
    env = {
        "FORGE_MODEL_SERVER_GRPC_PORT": "0",
        "FORGE_MODEL_SERVER_HTTP_PORT": "0",
        "FORGE_MODEL_SERVER_AUTH_TOKEN": UPSTREAM_TOKEN,
        "FORGE_MODEL_SERVER_MODELS_DIR": str(tiny_folder.parent),
        "FORGE_MODEL_SERVER_KAFKA_ENABLED": "false",
        "FORGE_MODEL_SERVER_TORCH_THREADS": "1",
    }
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
async def base_url(gateway: InferenceGateway) -> AsyncIterator[str]:
    app = make_app("inference_gateway")
    install_gateway_api(app, gateway, ADMIN_TOKEN)
    server = HttpServer(app, "127.0.0.1", 0)
    await server.start()
    yield f"http://127.0.0.1:{server.port}/v1"
    await server.stop()


@pytest.fixture
async def client(base_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=60) as sdk:
        yield sdk


async def test_chat_and_completions_whole_and_streamed(client: openai.AsyncOpenAI) -> None:
    whole = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0)
    stream = await client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, stream=True
    )
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == whole.choices[0].text != ""
    chat = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=5, temperature=0
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 5
    chunks = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
        max_tokens=5,
        temperature=0,
        stream=True,
    )
    streamed = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
    assert streamed == chat.choices[0].message.content


async def test_sampling_parameters_reach_the_engine(client: openai.AsyncOpenAI, tiny_folder: Path) -> None:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tiny_folder))
    token = tokenizer.encode(" question")[-1]
    forced = await client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logit_bias={str(token): 100}, n=2
    )
    expected = tokenizer.decode([token] * 4, skip_special_tokens=True)
    assert [c.text for c in forced.choices] == [expected, expected]
    plain = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0)
    penalised = await client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, presence_penalty=2.0
    )
    assert penalised.choices[0].text != plain.choices[0].text
    by_ids = await client.completions.create(
        model="tiny", prompt=tokenizer.encode(PROMPT), max_tokens=10, temperature=0
    )
    assert by_ids.choices[0].text == plain.choices[0].text


async def test_refusals_arrive_as_exception_classes(client: openai.AsyncOpenAI, base_url: str) -> None:
    with pytest.raises(openai.BadRequestError) as unsupported:
        await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        )
    assert unsupported.value.code == "unsupported_parameter" and unsupported.value.param == "tools"
    with pytest.raises(openai.BadRequestError) as out_of_range:
        await client.completions.create(model="tiny", prompt="hi", frequency_penalty=7)
    assert out_of_range.value.param == "frequency_penalty"
    with pytest.raises(openai.BadRequestError) as image:
        await client.chat.completions.create(
            model="tiny",
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y"}}]}
            ],
        )
    assert image.value.param == "messages.0.content.0"
    with pytest.raises(openai.BadRequestError) as bad_ids:
        await client.completions.create(model="tiny", prompt=[10**7], max_tokens=1)
    assert bad_ids.value.param == "prompt"
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="no-such-model", prompt="hi")
    async with openai.AsyncOpenAI(base_url=base_url, api_key="not-a-key", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError):
            await stranger.models.list()
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}) as raw:
        for reply, status in ((await raw.get("/nowhere"), 404), (await raw.put("/models"), 405)):
            assert reply.status_code == status
            assert set(reply.json()["error"]) == {"message", "type", "param", "code"}
        reply = await raw.post("/completions", json={"model": "tiny"})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"


async def test_models_retrieve(client: openai.AsyncOpenAI) -> None:
    assert "tiny" in [m.id async for m in client.models.list()]
    assert (await client.models.retrieve("tiny")).id == "tiny"
    with pytest.raises(openai.NotFoundError) as missing:
        await client.models.retrieve("no-such-model")
    assert missing.value.code == "model_not_found"


async def test_over_the_tenants_rate_is_a_rate_limit_error(gateway: InferenceGateway, base_url: str) -> None:
    _, key = await gateway.tenants.create_tenant("slow", rpm_limit=1)
    async with openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0) as sdk:
        await sdk.models.list()
        with pytest.raises(openai.RateLimitError) as limited:
            await sdk.models.list()
    assert int(limited.value.response.headers["retry-after"]) >= 1
