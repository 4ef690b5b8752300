"""gRPC kit against real servers on 127.0.0.1: auth, error mapping, deadlines, retries, metrics."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest
import pytest_asyncio
from forge.rerank.v1 import rerank_pb2, rerank_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import REGISTRY

from forge_kit import errors
from forge_kit.grpckit import (
    FIELD_METADATA_KEY,
    GrpcServer,
    check_health,
    make_channel,
    remaining_deadline,
    serve,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]

TOKEN = "s3cret"
#: The ``running`` server's default deadline, and the "slow" handler's time: apart enough that
#: the checks between them hold on a loaded machine.
DEFAULT_DEADLINE_S, SLOW_S = 2.0, 30.0
SERVICE_NAME = rerank_pb2.DESCRIPTOR.services_by_name["RerankerService"].full_name
METHOD = f"/{SERVICE_NAME}/Rerank"


@dataclass
class Reranker(rerank_pb2_grpc.RerankerServiceServicer):
    """Behaviour chosen by the query; ``calls`` counts handler invocations per query."""

    downstream: str | None = None
    downstream_query: str = "remaining"
    downstream_timeout: float | None = None
    calls: Counter[str] = field(default_factory=Counter)

    async def Rerank(
        self, request: rerank_pb2.RerankRequest, context: grpc.aio.ServicerContext
    ) -> rerank_pb2.RerankResponse:
        query = request.query
        self.calls[query] += 1
        if query == "invalid":
            raise errors.ValidationError("spec.team", "must not be empty")
        if query == "missing":
            raise errors.NotFoundError("job j-1 not found")
        if query == "overloaded":
            raise errors.OverloadedError("queue full", retry_after_s=2.5)
        if query == "unanswered":
            raise errors.UnavailableError("the store did not answer; retry", retry_after_s=1.5)
        if query == "bug":
            raise RuntimeError("password=hunter2 in a stack trace")
        if query == "slow":  # far past every deadline the tests set: only a deadline ends it
            await asyncio.sleep(SLOW_S)
        if query == "flaky" and self.calls[query] <= 2:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "warming up")
        if query == "down":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "down")
        if query == "proxy":
            mine = remaining_deadline()
            assert self.downstream is not None
            async with make_channel(self.downstream, token=TOKEN) as channel:
                reply = await rerank_pb2_grpc.RerankerServiceStub(channel).Rerank(
                    rerank_pb2.RerankRequest(query=self.downstream_query), timeout=self.downstream_timeout
                )
            return rerank_pb2.RerankResponse(
                model="proxy",
                results=[
                    rerank_pb2.RankedPassage(id="upstream", score=mine or -1.0),
                    rerank_pb2.RankedPassage(id="downstream", score=reply.results[0].score),
                ],
            )
        if query == "remaining":
            left = context.time_remaining()
            in_kit = remaining_deadline()
            return rerank_pb2.RerankResponse(
                model="remaining",
                results=[
                    rerank_pb2.RankedPassage(id="context", score=-1.0 if left is None else left),
                    rerank_pb2.RankedPassage(id="kit", score=-1.0 if in_kit is None else in_kit),
                ],
            )
        return rerank_pb2.RerankResponse(model="echo:" + query)


async def start(
    servicer: Reranker, *, service: str = "reranker", default_deadline_s: float = 30.0
) -> GrpcServer:
    return await serve(
        service=service,
        register=[lambda s: rerank_pb2_grpc.add_RerankerServiceServicer_to_server(servicer, s)],
        service_names=[SERVICE_NAME],
        host="127.0.0.1",
        port=0,
        token=TOKEN,
        default_deadline_s=default_deadline_s,
    )


@dataclass
class Running:
    servicer: Reranker
    server: GrpcServer

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"


@pytest_asyncio.fixture
async def running() -> AsyncIterator[Running]:
    servicer = Reranker()
    server = await start(servicer, default_deadline_s=DEFAULT_DEADLINE_S)
    yield Running(servicer, server)
    await server.stop(0)


async def call(channel: grpc.aio.Channel, query: str, **kwargs: object) -> rerank_pb2.RerankResponse:
    stub = rerank_pb2_grpc.RerankerServiceStub(channel)
    return await stub.Rerank(rerank_pb2.RerankRequest(query=query), **kwargs)  # type: ignore[no-any-return]


async def rpc_error(channel: grpc.aio.Channel, query: str, **kwargs: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(channel, query, **kwargs)
    return info.value


def requests_total(service: str, code: str) -> float:
    value = REGISTRY.get_sample_value(
        "forge_grpc_requests_total", {"service": service, "method": METHOD, "code": code}
    )
    return value or 0.0


@pytest.mark.asyncio
async def test_health_is_serving_without_a_token_and_not_serving_after_stop() -> None:
    server = await start(Reranker())
    target = f"127.0.0.1:{server.port}"
    assert await check_health(target)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=2)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        await server.set_serving(False)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=2)
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert not await check_health(target)
    await server.stop(0)
    assert not await check_health(target, timeout_s=0.5)


@pytest.mark.asyncio
async def test_reflection_lists_the_service(running: Running) -> None:
    async with grpc.aio.insecure_channel(running.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)

        async def requests() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        names = []
        async for reply in stub.ServerReflectionInfo(requests(), timeout=5):
            names = [s.name for s in reply.list_services_response.service]
    assert SERVICE_NAME in names
    assert "grpc.health.v1.Health" in names


@pytest.mark.asyncio
async def test_reflection_v1_lists_and_describes_services(running: Running) -> None:
    """A v1-only client (grpcurl's first choice): the same messages under ``grpc.reflection.v1``;
    it lists the services, both reflection versions among them, and can describe v1 itself."""
    from google.protobuf import descriptor_pb2

    async with grpc.aio.insecure_channel(running.target) as channel:
        info = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )

        async def requests() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
            yield reflection_pb2.ServerReflectionRequest(list_services="")
            yield reflection_pb2.ServerReflectionRequest(
                file_containing_symbol="grpc.reflection.v1.ServerReflection"
            )
            yield reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME)

        replies = [reply async for reply in info(requests(), timeout=5)]
    names = [s.name for s in replies[0].list_services_response.service]
    assert {
        SERVICE_NAME,
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= set(names)
    described = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for reply in replies[1:]
        for raw in reply.file_descriptor_response.file_descriptor_proto
    ]
    packages = {d.package for d in described}
    assert "grpc.reflection.v1" in packages and SERVICE_NAME.rsplit(".", 1)[0] in packages
    v1 = next(d for d in described if d.package == "grpc.reflection.v1")
    assert v1.service[0].method[0].input_type == ".grpc.reflection.v1.ServerReflectionRequest"


@pytest.mark.asyncio
async def test_calls_need_the_bearer_token(running: Running) -> None:
    async with grpc.aio.insecure_channel(running.target) as channel:
        assert (await rpc_error(channel, "hi", timeout=5)).code() is grpc.StatusCode.UNAUTHENTICATED
        wrong = (("authorization", "Bearer nope"),)
        error = await rpc_error(channel, "hi", timeout=5, metadata=wrong)
        assert error.code() is grpc.StatusCode.UNAUTHENTICATED
    async with make_channel(running.target, token="nope") as channel:
        assert (await rpc_error(channel, "hi")).code() is grpc.StatusCode.UNAUTHENTICATED
    async with make_channel(running.target, token=TOKEN) as channel:
        assert (await call(channel, "hi")).model == "echo:hi"
    assert running.servicer.calls["hi"] == 1


@pytest.mark.asyncio
async def test_validation_error_is_invalid_argument_naming_the_field(running: Running) -> None:
    async with make_channel(running.target, token=TOKEN) as channel:
        error = await rpc_error(channel, "invalid")
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "spec.team" in (error.details() or "")
    assert "must not be empty" in (error.details() or "")
    assert (FIELD_METADATA_KEY, "spec.team") in tuple(error.trailing_metadata() or ())


@pytest.mark.asyncio
async def test_domain_errors_map_to_status_codes(running: Running) -> None:
    async with make_channel(running.target, token=TOKEN) as channel:
        missing = await rpc_error(channel, "missing")
        overloaded = await rpc_error(channel, "overloaded")
        unanswered = await rpc_error(channel, "unanswered")
        bug = await rpc_error(channel, "bug")
    assert missing.code() is grpc.StatusCode.NOT_FOUND
    assert "j-1" in (missing.details() or "")
    assert overloaded.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("retry-after-ms", "2500") in tuple(overloaded.trailing_metadata() or ())
    assert unanswered.code() is grpc.StatusCode.UNAVAILABLE
    assert ("retry-after-ms", "1500") in tuple(unanswered.trailing_metadata() or ())
    assert bug.code() is grpc.StatusCode.INTERNAL
    assert "hunter2" not in (bug.details() or "")
    assert "password" not in (bug.details() or "")


@pytest.mark.asyncio
async def test_a_call_without_deadline_gets_the_default_one(running: Running) -> None:
    async with make_channel(running.target, token=TOKEN) as channel:
        started = time.monotonic()
        error = await rpc_error(channel, "slow")
        elapsed = time.monotonic() - started
        reply = await call(channel, "remaining")
    assert error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert elapsed < SLOW_S / 3
    kit_left = next(r.score for r in reply.results if r.id == "kit")
    assert DEFAULT_DEADLINE_S / 2 < kit_left <= DEFAULT_DEADLINE_S


@pytest.mark.asyncio
async def test_the_callers_deadline_wins_over_the_default(running: Running) -> None:
    async with make_channel(running.target, token=TOKEN) as channel:
        reply = await call(channel, "remaining", timeout=30.0)
    kit_left = next(r.score for r in reply.results if r.id == "kit")
    # Longer than the server's default, so only the caller's deadline explains it (and the
    # margin keeps the check honest on a loaded machine).
    assert DEFAULT_DEADLINE_S < kit_left <= 30.1


@pytest.mark.asyncio
async def test_deadline_propagates_to_downstream_calls() -> None:
    downstream = Reranker()
    down = await start(downstream, service="downstream", default_deadline_s=30.0)
    upstream = Reranker(downstream=f"127.0.0.1:{down.port}")
    up = await start(upstream, service="upstream", default_deadline_s=30.0)
    try:
        async with make_channel(f"127.0.0.1:{up.port}", token=TOKEN) as channel:
            reply = await call(channel, "proxy", timeout=5.0)
            no_deadline = await call(channel, "proxy")
    finally:
        await up.stop(0)
        await down.stop(0)
    # gRPC rounds a timeout up when it encodes it on the wire (by up to 100 ms for long ones).
    scores = {r.id: r.score for r in reply.results}
    assert 0.0 < scores["downstream"] <= scores["upstream"] + 0.02
    assert scores["upstream"] <= 5.1
    # Without a caller deadline the upstream default (30 s) still bounds the downstream call;
    # without propagation the downstream would see no deadline at all (-1).
    scores = {r.id: r.score for r in no_deadline.results}
    assert 0.0 < scores["downstream"] <= scores["upstream"] + 0.15
    assert scores["upstream"] <= 30.0


@pytest.mark.asyncio
async def test_downstream_deadline_exceeded_is_reported_as_deadline_exceeded() -> None:
    downstream = Reranker()
    down = await start(downstream, service="downstream", default_deadline_s=30.0)
    upstream = Reranker(downstream=f"127.0.0.1:{down.port}", downstream_query="slow", downstream_timeout=0.2)
    up = await start(upstream, service="upstream", default_deadline_s=30.0)
    try:
        async with make_channel(f"127.0.0.1:{up.port}", token=TOKEN) as channel:
            started = time.monotonic()
            error = await rpc_error(channel, "proxy", timeout=20)
            elapsed = time.monotonic() - started
    finally:
        await up.stop(0)
        await down.stop(0)
    assert error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert elapsed < SLOW_S / 3  # the downstream deadline ended it, not the slow handler
    assert downstream.calls["slow"] == 1


@pytest.mark.asyncio
async def test_unavailable_is_retried_a_bounded_number_of_times(running: Running) -> None:
    async with make_channel(running.target, token=TOKEN, max_attempts=4, initial_backoff_s=0.01) as channel:
        assert (await call(channel, "flaky", timeout=5)).model == "echo:flaky"
        error = await rpc_error(channel, "down", timeout=5)
    assert running.servicer.calls["flaky"] == 3
    assert error.code() is grpc.StatusCode.UNAVAILABLE
    assert running.servicer.calls["down"] == 4


@pytest.mark.asyncio
async def test_not_retryable_errors_are_not_retried(running: Running) -> None:
    async with make_channel(running.target, token=TOKEN, initial_backoff_s=0.01) as channel:
        await rpc_error(channel, "missing", timeout=5)
    assert running.servicer.calls["missing"] == 1


@pytest.mark.asyncio
async def test_requests_are_counted_by_status(running: Running) -> None:
    service = "reranker"
    ok_before = requests_total(service, "OK")
    invalid_before = requests_total(service, "INVALID_ARGUMENT")
    unauth_before = requests_total(service, "UNAUTHENTICATED")
    unavailable_before = requests_total(service, "UNAVAILABLE")
    async with make_channel(running.target, token=TOKEN, max_attempts=2, initial_backoff_s=0.01) as channel:
        await call(channel, "a")
        await call(channel, "b")
        await rpc_error(channel, "invalid")
        await rpc_error(channel, "down")
    async with make_channel(running.target) as channel:
        await rpc_error(channel, "a")
    assert requests_total(service, "OK") == ok_before + 2
    assert requests_total(service, "INVALID_ARGUMENT") == invalid_before + 1
    assert requests_total(service, "UNAUTHENTICATED") == unauth_before + 1
    assert requests_total(service, "UNAVAILABLE") == unavailable_before + 2
