"""The real engine behind the OpenAI HTTP API: a saved tiny Llama answers through the loader."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from forge.inference.v1 import inference_pb2, inference_pb2_grpc
from prometheus_client import REGISTRY
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from forge_kit import errors
from forge_kit.grpckit import make_channel
from forge_kit.http import make_app
from forge_kit.objectstore import ObjectStore
from forge_kit.testing import eventually
from forge_kit.testing.grpcserver import grpc_test_server
from forge_model_server.engine.async_engine import AsyncEngine, HFEngineLoader
from forge_model_server.engine.core import EngineConfig
from forge_model_server.entrypoints.grpc_api import InferenceApi
from forge_model_server.entrypoints.openai_api import install_openai_api
from forge_model_server.service import GenerationRequest, ModelDirectory, ModelServer

TOKEN = "live-token"
PROMPT = "To be, or not to be"


def live_server(models: Path, *, max_waiting: int = 8) -> ModelServer:
    loader = HFEngineLoader(EngineConfig(num_blocks=64, block_size=8), max_waiting=max_waiting)
    return ModelServer(ModelDirectory(ObjectStore(str(models))), loader=loader)


def client(server: ModelServer) -> httpx.AsyncClient:
    app = make_app("model_server")
    install_openai_api(app, server, TOKEN)
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
        base_url="http://model-server",
        headers={"Authorization": f"Bearer {TOKEN}"},
    )


@pytest.fixture
def models(tmp_path: Path, tiny_llama: Path) -> Path:
    shutil.copytree(tiny_llama, tmp_path / "models" / "tiny")
    return tmp_path / "models"


@pytest.fixture
async def server(models: Path) -> AsyncIterator[ModelServer]:
    server = live_server(models)
    yield server
    await server.drain(0)


@pytest.fixture
async def http(server: ModelServer) -> AsyncIterator[httpx.AsyncClient]:
    async with client(server) as c:
        yield c


async def test_completion_is_the_models_greedy_text(http: httpx.AsyncClient, tiny_llama: Path) -> None:
    reply = await http.post(
        "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tiny_llama))
    ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        ref = LlamaForCausalLM.from_pretrained(tiny_llama).generate(
            torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=tokenizer.eos_token_id
        )
    expected = tokenizer.decode(ref[0, len(ids) :], skip_special_tokens=True)
    assert body["choices"][0]["text"] == expected and expected
    assert body["usage"]["prompt_tokens"] == len(ids)


async def test_streaming_chat_equals_the_whole_answer(http: httpx.AsyncClient) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "the question"}],
        "max_tokens": 10,
        "seed": 11,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = (await http.post("/v1/chat/completions", json=body)).json()
    async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        lines = [line async for line in reply.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    choice = whole["choices"][0]
    assert streamed == choice["message"]["content"]
    content = choice["logprobs"]["content"]
    assert len(content) == whole["usage"]["completion_tokens"] and len(content[0]["top_logprobs"]) == 2


async def test_prompt_logprobs_cover_the_prompt(http: httpx.AsyncClient) -> None:
    reply = await http.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 0, "logprobs": 1},
    )
    choice = reply.json()["choices"][0]
    assert choice["prompt_logprobs"][0] is None
    assert len(choice["prompt_logprobs"]) == reply.json()["usage"]["prompt_tokens"]
    assert all(next(iter(e.values()))["logprob"] <= 0 for e in choice["prompt_logprobs"][1:])
    assert len(choice["logprobs"]["tokens"]) == 1


async def test_full_queue_is_429_with_retry_after(models: Path) -> None:
    server = live_server(models, max_waiting=0)
    async with client(server) as http:
        reply = await http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT})
    assert reply.status_code == 429 and reply.headers["Retry-After"] == "1"
    assert reply.json()["error"]["code"] == "rate_limit_exceeded"


async def test_prompt_longer_than_the_context_is_400(http: httpx.AsyncClient) -> None:
    reply = await http.post("/v1/completions", json={"model": "tiny", "prompt": "to be " * 300})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"
    reply = await http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 255})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "max_tokens"


async def test_disconnect_returns_every_block(server: ModelServer) -> None:
    # ignore_eos: the random tiny model samples its EOS token now and then, and a request that
    # finished by itself would hand its blocks back before the disconnect under test.
    request = GenerationRequest(model="tiny", prompt=PROMPT, max_tokens=200, ignore_eos=True)
    _, chunks = await server.generate(request)
    await chunks.__anext__()
    _, engine = server.resolve("tiny")
    assert isinstance(engine, AsyncEngine) and engine.core.pool.usage() > 0
    await chunks.aclose()  # the client went away mid-stream
    _, unstarted = await server.generate(request)
    await unstarted.aclose()  # ... or before the first token
    await eventually(
        lambda: engine.core.pool.num_free() == engine.core.config.num_blocks and not engine.core.has_work(),
        what="every KV block back and no work left",
    )


async def test_metrics_follow_the_engine(http: httpx.AsyncClient) -> None:
    def sample(name: str) -> float:
        return REGISTRY.get_sample_value(name, {"model_name": "tiny"}) or 0.0

    ttft, queries = (
        sample("vllm:time_to_first_token_seconds_count"),
        sample("vllm:prefix_cache_queries_total"),
    )
    for _ in range(2):
        await http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT * 3, "max_tokens": 3})
    assert sample("vllm:time_to_first_token_seconds_count") == ttft + 2
    assert sample("vllm:prefix_cache_queries_total") > queries
    assert sample("vllm:prefix_cache_hits_total") > 0
    text = (await http.get("/metrics")).text
    for name in ("vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds", "vllm:num_preemptions"):
        assert f"# TYPE {name}" in text


async def test_drain_finishes_admitted_requests_and_refuses_new_ones(server: ModelServer) -> None:
    # ignore_eos: a sampled end-of-text before the 5th token (the random model does that now and
    # then) would end the request early with "stop", which is not what this test is about.
    _, chunks = await server.generate(
        GenerationRequest(model="tiny", prompt=PROMPT, max_tokens=5, ignore_eos=True)
    )
    drained = asyncio.create_task(server.drain(5))
    received = [c async for c in chunks]
    await drained
    assert received[-1].finish_reason == "length" and received[-1].completion_tokens == 5
    with pytest.raises(errors.OverloadedError, match="draining"):
        await server.generate(GenerationRequest(model="tiny", prompt=PROMPT))


async def test_full_queue_is_resource_exhausted_over_grpc(models: Path) -> None:
    server = live_server(models, max_waiting=0)
    async with (
        grpc_test_server(
            inference_pb2_grpc.add_InferenceServiceServicer_to_server,
            InferenceApi(server),
            "forge.inference.v1.InferenceService",
            token=TOKEN,
            service="model_server",
        ) as started,
        make_channel(f"127.0.0.1:{started.port}", token=TOKEN) as channel,
    ):
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.Generate(
                inference_pb2.GenerateRequest(model="tiny", prompt=PROMPT), timeout=5
            ):
                pass
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_a_repeated_client_request_id_is_served_twice(server: ModelServer) -> None:
    first = GenerationRequest(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, request_id="same")
    second = GenerationRequest(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, request_id="same")
    _, a = await server.generate(first)
    _, b = await server.generate(second)
    texts = ["".join([c.text async for c in stream]) for stream in (a, b)]
    assert texts[0] == texts[1]


async def test_echo_with_logprobs_scores_the_prompt_as_vllm_does(http: httpx.AsyncClient) -> None:
    """The eval service's log-likelihood request: echo, one token, top-1 logprobs."""
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 1,
        "temperature": 0.0,
        "echo": True,
        "logprobs": 1,
    }
    reply = await http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    choice, usage = reply.json()["choices"][0], reply.json()["usage"]
    assert choice["text"].startswith(PROMPT)
    lps = choice["logprobs"]
    assert len(lps["tokens"]) == usage["prompt_tokens"] + 1
    assert lps["token_logprobs"][0] is None and all(v <= 0 for v in lps["token_logprobs"][1:])
    assert "".join(lps["tokens"][: usage["prompt_tokens"]]) == PROMPT
    assert lps["text_offset"][usage["prompt_tokens"]] == len(PROMPT)


async def test_tokenize_counts_what_generation_feeds_the_model(http: httpx.AsyncClient) -> None:
    """``/tokenize`` (vLLM's route) counts exactly the prompt tokens a completion then reports."""
    messages = [{"role": "user", "content": PROMPT}]
    for body in ({"prompt": PROMPT}, {"messages": messages}):
        counted = await http.post("/tokenize", json={"model": "tiny", **body})
        assert counted.status_code == 200, counted.text
        route = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        answered = await http.post(route, json={"model": "tiny", **body, "max_tokens": 1})
        assert answered.status_code == 200, answered.text
        reply = counted.json()
        assert reply["count"] == len(reply["tokens"]) == answered.json()["usage"]["prompt_tokens"] > 0
        assert reply["max_model_len"] > reply["count"]
    # The chat template adds tokens around the message.
    plain = (await http.post("/tokenize", json={"model": "tiny", "prompt": PROMPT})).json()["count"]
    chat = (await http.post("/tokenize", json={"model": "tiny", "messages": messages})).json()["count"]
    assert chat > plain


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "tiny"}, "prompt"),
        ({"model": "tiny", "prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "messages"),
        ({"model": "tiny", "messages": [{"role": "robot", "content": "a"}]}, "messages.0.role"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "a"}], "add_special_tokens": False},
            "add_special_tokens",
        ),
        ({"model": "tiny", "prompt": "a", "add_generation_prompt": False}, "add_generation_prompt"),
        ({"model": "", "prompt": "a"}, "model"),
    ],
)
async def test_tokenize_refuses_bad_input_naming_the_field(
    http: httpx.AsyncClient, body: dict[str, object], param: str
) -> None:
    reply = await http.post("/tokenize", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


async def test_tokenize_of_an_unknown_model_is_404(http: httpx.AsyncClient) -> None:
    reply = await http.post("/tokenize", json={"model": "nope", "prompt": "a"})
    assert reply.status_code == 404 and reply.json()["error"]["param"] == "model"


async def test_a_list_of_prompts_answers_each_as_if_sent_alone(http: httpx.AsyncClient) -> None:
    """vLLM's list ``prompt``: one choice per prompt by index, each the same text (and, to float
    rounding, the same logprobs) as that prompt sent alone with the same seed; usage summed."""
    prompts = [PROMPT, "Good morrow", "What light through yonder window"]
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0.8, "seed": 7, "echo": True, "logprobs": 1}
    together = await http.post("/v1/completions", json={**body, "prompt": prompts})
    assert together.status_code == 200, together.text
    choices = together.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    alone = [(await http.post("/v1/completions", json={**body, "prompt": p})).json() for p in prompts]
    for choice, single in zip(choices, alone, strict=True):
        assert choice["text"] == single["choices"][0]["text"]
        # Batched with other prompts, the same sums may round differently in the last bits.
        got, want = choice["logprobs"], single["choices"][0]["logprobs"]
        assert got["tokens"] == want["tokens"] and got["text_offset"] == want["text_offset"]
        assert got["token_logprobs"][0] is None and want["token_logprobs"][0] is None
        assert got["token_logprobs"][1:] == pytest.approx(want["token_logprobs"][1:], abs=1e-4)
    usage = together.json()["usage"]
    assert usage["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert usage["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a"] * 257}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": ["a"] * 17, "n": 16}, "n"),
    ],
)
async def test_a_bad_list_of_prompts_is_400(
    http: httpx.AsyncClient, extra: dict[str, object], param: str
) -> None:
    reply = await http.post("/v1/completions", json={"model": "tiny", "max_tokens": 2, **extra})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param


async def test_a_list_with_one_prompt_too_long_is_refused_whole(
    server: ModelServer, http: httpx.AsyncClient
) -> None:
    """A prompt the context cannot hold refuses the call; the prompts admitted before it are
    cancelled, so no request or KV block is left behind."""
    reply = await http.post(
        "/v1/completions", json={"model": "tiny", "max_tokens": 2, "prompt": ["short", "x " * 5000]}
    )
    assert reply.status_code == 400, reply.text
    engine = server.resolve("tiny")[1]
    core = engine.core  # type: ignore[attr-defined]
    await eventually(lambda: not core.running and not core.waiting, what="the admitted prompts cancelled")
    assert core.pool.usage() == 0
