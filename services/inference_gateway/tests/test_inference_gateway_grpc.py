"""The gateway's gRPC InferenceService on a real server, upstream answers replayed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from forge.inference.v1 import inference_pb2, inference_pb2_grpc

from forge_inference_gateway.api import GatewayInferenceApi
from forge_inference_gateway.service import InferenceGateway
from forge_kit.grpckit import FIELD_METADATA_KEY, GrpcServer, make_channel
from forge_kit.testing.grpcserver import grpc_test_server

TOKEN = "grpc-token"


@pytest.fixture
def upstream_url(recorded: Any) -> str:
    return str(recorded.url)


@pytest.fixture
async def server(gateway: InferenceGateway) -> AsyncIterator[GrpcServer]:
    async with grpc_test_server(
        inference_pb2_grpc.add_InferenceServiceServicer_to_server,
        GatewayInferenceApi(gateway),
        "forge.inference.v1.InferenceService",
        token=TOKEN,
        service="inference_gateway",
    ) as started:
        yield started


@pytest.fixture
async def stub(server: GrpcServer) -> AsyncIterator[inference_pb2_grpc.InferenceServiceStub]:
    async with make_channel(f"127.0.0.1:{server.port}", token=TOKEN) as channel:
        yield inference_pb2_grpc.InferenceServiceStub(channel)


async def _generate(
    stub: inference_pb2_grpc.InferenceServiceStub, **fields: Any
) -> list[inference_pb2.GenerateResponse]:
    request = inference_pb2.GenerateRequest(**fields)
    return [chunk async for chunk in stub.Generate(request, timeout=5)]


async def test_generate_translates_the_upstream_stream(
    stub: inference_pb2_grpc.InferenceServiceStub, recorded: Any, gateway: InferenceGateway
) -> None:
    await gateway.pool.refresh()  # the control loop's scrape: what the replica serves
    messages = [inference_pb2.ChatMessage(role="user", content="hi")]
    chunks = await _generate(
        stub, model="tiny", messages=messages, max_tokens=2, temperature=0.0, request_id="r-9"
    )
    assert [c.text_delta for c in chunks] == ["To be", ", or not", ""]
    last = chunks[-1]
    assert last.finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (4, 2)
    assert {c.request_id for c in chunks} == {"r-9"}
    # Every chunk names the version that served it: the one the replica lists for ``tiny``.
    assert {(c.model.name, c.model.version) for c in chunks} == {("tiny", "7")}
    sent = recorded.requests[-1]
    assert sent.path == "/v1/chat/completions"
    body = sent.body
    assert body["max_tokens"] == 2 and body["temperature"] == 0.0 and body["stream"] is True


async def test_upstream_404_is_not_found(stub: inference_pb2_grpc.InferenceServiceStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _generate(stub, model="huge", prompt="hi")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "`huge` does not exist" in caught.value.details()


async def test_unknown_tenant_and_missing_model_are_invalid(
    stub: inference_pb2_grpc.InferenceServiceStub,
) -> None:
    for fields, field in (
        ({"model": "tiny", "prompt": "x", "tenant": "ghost"}, "tenant"),
        ({"prompt": "x"}, "model"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _generate(stub, **fields)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (FIELD_METADATA_KEY, field) in tuple(caught.value.trailing_metadata() or ())


async def test_call_without_token_is_unauthenticated(server: GrpcServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await inference_pb2_grpc.InferenceServiceStub(channel).ListModels(
                inference_pb2.ListModelsRequest()
            )
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
