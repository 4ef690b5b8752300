"""The model server through the official ``openai`` SDK: a live tiny Llama served by uvicorn on a
free port, called as any OpenAI client calls it (chat and completions, streamed and whole, the
sampling parameters vLLM honours, and every error as the SDK's exception class)."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest
from transformers import PreTrainedTokenizerFast

from forge_kit.http import HttpServer, make_app
from forge_kit.objectstore import ObjectStore
from forge_model_server.engine.async_engine import HFEngineLoader
from forge_model_server.engine.core import EngineConfig
from forge_model_server.entrypoints.openai_api import install_openai_api
from forge_model_server.service import ModelDirectory, ModelServer

TOKEN = "sdk-token"
PROMPT = "To be, or not to be, to be, or not to be, to be"


async def _serve(models: Path, *, max_waiting: int = 8) -> tuple[HttpServer, ModelServer]:
    loader = HFEngineLoader(EngineConfig(num_blocks=64, block_size=8), max_waiting=max_waiting)
    server = ModelServer(ModelDirectory(ObjectStore(str(models))), loader=loader)
    app = make_app("model_server")
    install_openai_api(app, server, TOKEN)
    http = HttpServer(app, "127.0.0.1", 0)
    await http.start()
    return http, server


@pytest.fixture
def models(tmp_path: Path, tiny_llama: Path) -> Path:
    shutil.copytree(tiny_llama, tmp_path / "models" / "tiny")
    return tmp_path / "models"


@pytest.fixture
async def base_url(models: Path) -> AsyncIterator[str]:
    http, server = await _serve(models)
    yield f"http://127.0.0.1:{http.port}/v1"
    await server.drain(0)
    await http.stop()


@pytest.fixture
async def client(base_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=base_url, api_key=TOKEN, max_retries=0, timeout=60) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(str(tiny_llama))


async def _greedy(client: openai.AsyncOpenAI, **extra: object) -> str:
    reply = await client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        **extra,  # type: ignore[arg-type]
    )
    return reply.choices[0].text


async def test_completions_whole_and_streamed_agree(client: openai.AsyncOpenAI) -> None:
    whole = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    assert whole.object == "text_completion" and whole.usage is not None
    assert whole.usage.completion_tokens == 6 and whole.choices[0].finish_reason == "length"
    stream = await client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, stream=True
    )
    pieces = [chunk.choices[0].text async for chunk in stream if chunk.choices]
    assert "".join(pieces) == whole.choices[0].text != ""


async def test_chat_whole_and_streamed_agree(client: openai.AsyncOpenAI) -> None:
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": PROMPT}]
    whole = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content
    stream = await client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


async def test_content_parts_are_joined_as_vllm_joins_them(client: openai.AsyncOpenAI) -> None:
    parts = await client.chat.completions.create(
        model="tiny",
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "To be"}, {"type": "text", "text": "or not"}],
            }
        ],
        max_tokens=6,
        temperature=0,
    )
    plain = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "To be\nor not"}], max_tokens=6, temperature=0
    )
    assert parts.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(
            model="tiny",
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}
            ],
        )
    assert refused.value.param == "messages.0.content.0" and "image" in refused.value.message


async def test_logit_bias_forces_a_token(
    client: openai.AsyncOpenAI, tokenizer: PreTrainedTokenizerFast
) -> None:
    token = tokenizer.encode(" question")[-1]
    text = await _greedy(client, logit_bias={str(token): 100})
    assert text == tokenizer.decode([token] * 12, skip_special_tokens=True)
    assert text != await _greedy(client)


async def test_penalties_change_greedy_output_on_a_repetitive_prompt(client: openai.AsyncOpenAI) -> None:
    plain = await _greedy(client)
    for extra in (
        {"presence_penalty": 2.0},
        {"frequency_penalty": 2.0},
        {"extra_body": {"repetition_penalty": 2.0}},
    ):
        assert await _greedy(client, **extra) != plain, extra
    # A penalty of 0 (or 1 for repetition) is no penalty at all.
    assert await _greedy(client, presence_penalty=0.0, extra_body={"repetition_penalty": 1.0}) == plain


async def test_n_returns_n_choices_whole_and_streamed(client: openai.AsyncOpenAI) -> None:
    whole = await client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5, n=3
    )
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert len({c.text for c in whole.choices}) > 1  # seeds 5, 6, 7: different samples
    assert whole.usage is not None and whole.usage.completion_tokens == 24
    stream = await client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5, n=3, stream=True
    )
    texts = ["", "", ""]
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in whole.choices]
    chat = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, n=2
    )
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content


async def test_min_tokens_prevents_early_eos(
    client: openai.AsyncOpenAI, tokenizer: PreTrainedTokenizerFast
) -> None:
    eos = {str(tokenizer.eos_token_id): 100}
    early = await client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, logit_bias=eos
    )
    assert early.usage is not None and early.usage.completion_tokens == 1
    assert early.choices[0].finish_reason == "stop"
    held = await client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        logit_bias=eos,
        extra_body={"min_tokens": 5},
    )
    assert held.usage is not None and held.usage.completion_tokens == 6  # 5 held, then EOS
    assert held.choices[0].finish_reason == "stop"


async def test_top_k_1_is_greedy(client: openai.AsyncOpenAI) -> None:
    greedy = await _greedy(client)
    sampled = await client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.5, seed=3, extra_body={"top_k": 1}
    )
    assert sampled.choices[0].text == greedy


async def test_token_id_prompts(client: openai.AsyncOpenAI, tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode(PROMPT)
    by_ids = await client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == await _greedy(client)
    two = await client.completions.create(model="tiny", prompt=[ids, ids[:3]], max_tokens=2, temperature=0)
    assert [c.index for c in two.choices] == [0, 1]
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model="tiny", prompt=[1, 10**6], max_tokens=2)
    assert refused.value.param == "prompt"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -9}, "frequency_penalty"),
        ({"n": 0}, "n"),
        ({"logit_bias": {"100000": 5}}, "logit_bias"),
        ({"extra_body": {"repetition_penalty": -1}}, "repetition_penalty"),
        ({"extra_body": {"min_tokens": -1}}, "min_tokens"),
        ({"extra_body": {"top_k": -7}}, "top_k"),
        ({"max_tokens": "many"}, "max_tokens"),
    ],
)
async def test_out_of_range_is_400_naming_the_parameter(
    client: openai.AsyncOpenAI, extra: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model="tiny", prompt="hi", **extra)  # type: ignore[arg-type]
    assert refused.value.status_code == 400 and refused.value.param == param


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"extra_body": {"functions": [{"name": "f"}]}}, "functions"),
    ],
)
async def test_parameters_that_cannot_be_honoured_are_refused(
    client: openai.AsyncOpenAI, extra: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            **extra,  # type: ignore[arg-type]
        )
    assert refused.value.code == "unsupported_parameter" and refused.value.param == param
    # What asks for nothing passes: plain text is what every answer is.
    await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=1,
        response_format={"type": "text"},
    )


async def test_models_retrieve_and_errors_by_class(client: openai.AsyncOpenAI, base_url: str) -> None:
    model = await client.models.retrieve("tiny")
    assert model.id == "tiny" and model.object == "model"
    assert [m.id async for m in client.models.list()] == ["tiny"]
    with pytest.raises(openai.NotFoundError) as missing:
        await client.models.retrieve("huge")
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="huge", prompt="hi")
    async with openai.AsyncOpenAI(base_url=base_url, api_key="wrong", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError):
            await stranger.models.list()
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {TOKEN}"}) as raw:
        for reply, status in ((await raw.get("/nowhere"), 404), (await raw.delete("/models"), 405)):
            assert reply.status_code == status
            assert set(reply.json()["error"]) == {"message", "type", "param", "code"}


async def test_a_full_queue_is_a_rate_limit_error(models: Path) -> None:
    http, server = await _serve(models, max_waiting=0)
    try:
        async with openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{http.port}/v1", api_key=TOKEN, max_retries=0
        ) as sdk:
            with pytest.raises(openai.RateLimitError) as limited:
                await sdk.completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert limited.value.response.headers["retry-after"]
    finally:
        await server.drain(0)
        await http.stop()
