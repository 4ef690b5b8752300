"""The gateway through the official ``openai`` SDK, in front of a real engine serving a tiny Llama:
Forge's model_server process, and vLLM (conformance: every test runs against both, so where both
engines answer, a client sees the same shapes and the same errors). What an OpenAI client sends
goes through routing to the engine and back, sampling parameters included, and every error arrives
as the SDK's exception class."""

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
from forge_kit.testing import ServiceProcess, base_env
from forge_kit.testing.processes import VllmServer, free_port
from forge_kit.testing.tiny_llama import save_tiny_llama
from forge_kit.vllm import VllmLaunch

from .conftest import ADMIN_TOKEN, API_KEY, build_gateway

# The first test against vLLM waits for its start (a minute or more, longer on a loaded machine).
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
UPSTREAM_TOKEN = "upstream-token"
PROMPT = "To be, or not to be, to be, or not to be, to be"
CORPUS = (
    "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer "
    "the slings and arrows of outrageous fortune, or to take arms against a sea of troubles."
)
#: Exports carry a chat template (vLLM refuses chat for a tokenizer without one); text parts joined.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] + ': ' }}{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Weights drawn wide so greedy choices are no near-ties, and a greedy continuation of
    # PROMPT that repeats itself (so a presence penalty has something to change). One head of
    # 64: a head size vLLM's CPU attention serves.
    folder = tmp_path_factory.mktemp("tiny") / "models" / "tiny"
    return save_tiny_llama(
        folder, corpus=[CORPUS] * 4, initializer_range=0.2, heads=1, kv_heads=1, chat_template=CHAT_TEMPLATE
    )


@pytest.fixture(scope="session")
def forge_engine(tiny_folder: Path) -> Iterator[str]:
    """Forge's model_server process serving the tiny Llama; its URL."""
    root = tiny_folder.parent.parent
    env = base_env(
        "model_server", token=UPSTREAM_TOKEN, models_dir=str(tiny_folder.parent), torch_threads="1"
    )
    proc = ServiceProcess("forge_model_server", env=env, cwd=str(root), log_path=str(root / "log")).start(60)
    yield proc.http_url
    proc.stop()


@pytest.fixture(scope="session")
def vllm_engine(tiny_folder: Path) -> Iterator[str]:
    """A vLLM server (from ``.venv-vllm``) serving the same folder as ``tiny``, float32 as Forge's
    engine computes; its URL. The one vLLM start of this test folder (a minute or more)."""
    launch = VllmLaunch(
        tiny_folder,
        free_port(),
        "tiny",
        api_key=UPSTREAM_TOKEN,
        threads=1,
        engine_args={"dtype": "float32", "max_model_len": 256, "max_num_seqs": 8, "enforce_eager": True},
    )
    server = VllmServer(launch, log_path=str(tiny_folder.parent.parent / "vllm.log")).start(600)
    yield server.url
    server.stop()


@pytest.fixture(scope="module", params=["forge", "vllm"])
def engine(request: pytest.FixtureRequest) -> str:
    """The URL of the engine behind the gateway: each test runs against Forge's and vLLM's."""
    return str(request.getfixturevalue(f"{request.param}_engine"))


@pytest.fixture
async def gateway(engine: str, db: Database) -> AsyncIterator[InferenceGateway]:
    service = build_gateway(db, [engine], request_timeout_s=60)
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
        model="tiny", prompt=PROMPT, max_tokens=4, temperature=1.0, logit_bias={str(token): 100}, n=2
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
    assert image.value.param == "messages.0.content.0" and image.value.code == "invalid_value"
    with pytest.raises(openai.BadRequestError) as bad_ids:
        await client.completions.create(model="tiny", prompt=[10**7], max_tokens=1)
    assert bad_ids.value.param == "prompt" and bad_ids.value.code == "invalid_value"
    assert bad_ids.value.body == {**bad_ids.value.body, "type": "invalid_request_error"}  # type: ignore[dict-item]
    with pytest.raises(openai.BadRequestError) as greedy_choices:
        await client.completions.create(model="tiny", prompt="hi", max_tokens=1, temperature=0, n=2)
    assert greedy_choices.value.param == "n"
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
