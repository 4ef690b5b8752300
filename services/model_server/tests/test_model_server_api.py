"""The OpenAI HTTP API (in process) and the gRPC InferenceService on a real server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import httpx
import pytest
from forge.inference.v1 import inference_pb2, inference_pb2_grpc

from forge_kit.grpckit import FIELD_METADATA_KEY, GrpcServer, make_channel
from forge_kit.testing.grpcserver import grpc_test_server
from forge_model_server.entrypoints.grpc_api import InferenceApi
from forge_model_server.service import ModelServer

TOKEN = "test-token"
CHAT = "/v1/chat/completions"


async def test_models_lists_the_directory(http: httpx.AsyncClient, make_model: Callable[..., Path]) -> None:
    make_model("tiny-llama", version="3", context=512)
    reply = await http.get("/v1/models")
    assert reply.status_code == 200
    (card,) = reply.json()["data"]
    assert card["id"] == "tiny-llama" and card["version"] == "3" and card["max_model_len"] == 512
    assert card["object"] == "model" and card["loaded"] is False


async def test_v1_requires_the_bearer_token(http: httpx.AsyncClient) -> None:
    reply = await http.get("/v1/models", headers={"Authorization": "Bearer wrong"})
    assert reply.status_code == 401
    assert reply.json()["error"]["type"] == "authentication_error"


async def test_chat_without_weights_is_404_model_not_found(
    http: httpx.AsyncClient, make_model: Callable[..., Path]
) -> None:
    make_model("tiny")
    reply = await http.post(CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert error["message"].startswith("no model loaded: tiny: no weights")
    assert set(error) == {"message", "type", "param", "code"}


async def test_unknown_model_is_404(http: httpx.AsyncClient) -> None:
    reply = await http.post("/v1/completions", json={"model": "huge", "prompt": "hi"})
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"
    assert "`huge` does not exist" in reply.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"messages": []}, "messages"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"top_k": -2}, "top_k"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages.0.content.0",
        ),
        ({"messages": "hello"}, "messages"),
        ({"model": None}, "model"),
    ],
)
async def test_bad_fields_are_400_naming_the_field(
    http: httpx.AsyncClient, body: dict[str, object], param: str
) -> None:
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **body}
    reply = await http.post(CHAT, json=request)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    assert reply.json()["error"]["type"] == "invalid_request_error"


async def test_malformed_json_is_400(http: httpx.AsyncClient) -> None:
    reply = await http.post(CHAT, content=b"{not json", headers={"Content-Type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"


async def test_metrics_carry_vllm_names_at_zero(http: httpx.AsyncClient, server: ModelServer) -> None:
    text = (await http.get("/metrics")).text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:e2e_request_latency_seconds",
    ):
        assert f"# TYPE {name} " in text
    assert (await http.get("/health")).status_code == 200


async def test_streaming_chat_is_sse_with_usage_and_done(
    scripted_http: httpx.AsyncClient, make_model: Callable[..., Path]
) -> None:
    make_model("tiny")
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with scripted_http.stream("POST", CHAT, json=body) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in reply.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == "To be, or not to be"
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    assert events[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


async def test_completion_non_streaming(
    scripted_http: httpx.AsyncClient, make_model: Callable[..., Path]
) -> None:
    make_model("tiny")
    reply = await scripted_http.post(
        "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3}
    )
    body = reply.json()
    assert reply.status_code == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "To be, or not to be" and body["usage"]["total_tokens"] == 6


@pytest.fixture
async def grpc_server(server: ModelServer) -> AsyncIterator[GrpcServer]:
    async with grpc_test_server(
        inference_pb2_grpc.add_InferenceServiceServicer_to_server,
        InferenceApi(server),
        "forge.inference.v1.InferenceService",
        token=TOKEN,
        service="model_server",
    ) as started:
        yield started


@pytest.fixture
async def stub(grpc_server: GrpcServer) -> AsyncIterator[inference_pb2_grpc.InferenceServiceStub]:
    async with make_channel(f"127.0.0.1:{grpc_server.port}", token=TOKEN) as channel:
        yield inference_pb2_grpc.InferenceServiceStub(channel)


async def test_grpc_list_models(
    stub: inference_pb2_grpc.InferenceServiceStub, make_model: Callable[..., Path]
) -> None:
    make_model("tiny", version="7", context=128)
    reply = await stub.ListModels(inference_pb2.ListModelsRequest())
    (model,) = reply.models
    assert (model.ref.name, model.ref.version, model.max_context_tokens, model.ready_replicas) == (
        "tiny",
        "7",
        128,
        0,
    )


async def test_grpc_generate_without_a_model_is_failed_precondition(
    stub: inference_pb2_grpc.InferenceServiceStub, make_model: Callable[..., Path]
) -> None:
    make_model("tiny")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in stub.Generate(inference_pb2.GenerateRequest(model="tiny", prompt="hi"), timeout=5):
            pass
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert caught.value.details().startswith("no model loaded: tiny:")


async def test_grpc_generate_unknown_model_is_not_found(
    stub: inference_pb2_grpc.InferenceServiceStub,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in stub.Generate(inference_pb2.GenerateRequest(model="huge", prompt="hi"), timeout=5):
            pass
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_grpc_generate_invalid_temperature_names_the_field(
    stub: inference_pb2_grpc.InferenceServiceStub,
) -> None:
    request = inference_pb2.GenerateRequest(model="tiny", prompt="hi", temperature=2.5)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in stub.Generate(request, timeout=5):
            pass
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (FIELD_METADATA_KEY, "temperature") in tuple(caught.value.trailing_metadata() or ())


async def test_grpc_generate_streams_engine_chunks(
    scripted_server: ModelServer, make_model: Callable[..., Path]
) -> None:
    make_model("tiny", version="2")
    async with (
        grpc_test_server(
            inference_pb2_grpc.add_InferenceServiceServicer_to_server,
            InferenceApi(scripted_server),
            "forge.inference.v1.InferenceService",
            token=TOKEN,
            service="model_server",
        ) as started,
        make_channel(f"127.0.0.1:{started.port}", token=TOKEN) as channel,
    ):
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        request = inference_pb2.GenerateRequest(model="tiny", prompt="hi", request_id="r-1")
        chunks = [c async for c in stub.Generate(request, timeout=5)]
    assert "".join(c.text_delta for c in chunks) == "To be, or not to be"
    assert chunks[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert chunks[-1].usage.completion_tokens == 3 and chunks[0].request_id == "r-1"
    assert (chunks[0].model.name, chunks[0].model.version) == ("tiny", "2")
