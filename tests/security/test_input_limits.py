"""Inputs that hurt, sent as an attacker would, to real service processes: bodies past the size
limit (announced and chunked), a long chat that used to freeze the model server's event loop while
it was tokenized, seeds past 2^63, NaN and infinity where numbers go, control characters and
megabyte names where a header or a path is built, and label maps without bounds.

Each answer must be a clear 4xx naming the field (gRPC: INVALID_ARGUMENT) — never a 500, a 502, a
dropped connection or a header echoing what the caller sent.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from forge.common.v1 import common_pb2
from forge.eval.v1 import eval_pb2, eval_pb2_grpc
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

from forge_kit.testing import ServiceProcess, base_env
from forge_kit.testing.tiny_llama import save_tiny_llama

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MODEL_SERVER_TOKEN = "limits-model-server-token"
GATEWAY_ADMIN_TOKEN = "limits-gateway-admin-token"
TENANT_KEY = "fk-limits-tenant-key"
SERVICE_TOKEN = "limits-service-token"
MODEL = "llama"
#: Past every default limit (the model server's is 8 MiB): the 30 MB body of the report.
HUGE = 30 * 1024 * 1024


def _service(service: str, data: Path, token: str, **settings: str) -> ServiceProcess:
    env = base_env(service, token=token, data_dir=data, **settings)
    return ServiceProcess(
        f"forge_{service}", env=env, log_path=str(data / "service.log"), cwd=str(data)
    ).start(90)


@pytest.fixture(scope="module")
def model_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    data = tmp_path_factory.mktemp("model-server")
    save_tiny_llama(data / "models" / MODEL)
    process = _service(
        "model_server",
        data,
        MODEL_SERVER_TOKEN,
        models_dir=str(data / "models"),
        torch_threads="1",
    )
    yield process
    process.stop()


@pytest.fixture(scope="module")
def gateway(
    model_server: ServiceProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    process = _service(
        "inference_gateway",
        tmp_path_factory.mktemp("gateway"),
        GATEWAY_ADMIN_TOKEN,
        model_server_url=model_server.http_url,
        model_server_token=MODEL_SERVER_TOKEN,
        bootstrap_api_key=TENANT_KEY,
        default_rpm_limit="1000000",
        retriever_target="127.0.0.1:1",
    )
    yield process
    process.stop()


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    data = tmp_path_factory.mktemp("scheduler")
    process = _service("scheduler", data, SERVICE_TOKEN)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def eval_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    data = tmp_path_factory.mktemp("eval")
    process = _service(
        "eval",
        data,
        SERVICE_TOKEN,
        response_cache_path=str(data / "cache.sqlite"),
    )
    yield process
    process.stop()


def _openai(process: ServiceProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{process.http_url}/v1", api_key=key, max_retries=0, timeout=60)


def _chat(**fields: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "To be"}], "max_tokens": 2, **fields}


def _assert_openai_error(reply: httpx.Response, status: int) -> dict[str, object]:
    assert reply.status_code == status, reply.text[:500]
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return dict(error)


# -- body size ------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["gateway", "model_server"])
def test_a_30_mb_body_is_refused_with_413_in_the_openai_format(
    target: str, request: pytest.FixtureRequest
) -> None:
    process: ServiceProcess = request.getfixturevalue(target)
    key = TENANT_KEY if target == "gateway" else MODEL_SERVER_TOKEN
    body = json.dumps(_chat(messages=[{"role": "user", "content": "x" * HUGE}])).encode()
    started = time.monotonic()
    reply = httpx.post(
        f"{process.http_url}/v1/chat/completions",
        content=body,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        timeout=60,
    )
    error = _assert_openai_error(reply, 413)
    assert error["code"] == "request_too_large" and "limit" in str(error["message"])
    assert time.monotonic() - started < 30
    # An OpenAI client gets an error it can read, not a reset connection or a 5xx.
    with pytest.raises(openai.APIStatusError) as refused:
        _openai(process, key).completions.create(model=MODEL, prompt="x" * HUGE, max_tokens=2)
    assert refused.value.status_code == 413
    assert refused.value.body["code"] == "request_too_large"  # type: ignore[index]
    assert httpx.get(f"{process.http_url}/healthz", timeout=10).status_code == 200


def test_a_chunked_body_without_length_is_cut_off_at_the_limit(gateway: ServiceProcess) -> None:
    """No ``Content-Length`` to refuse by: the bytes are counted as they arrive."""
    sent = 0

    def chunks() -> Iterator[bytes]:
        nonlocal sent
        yield b'{"model": "llama", "messages": [{"role": "user", "content": "'
        for _ in range(HUGE // 65536):
            sent += 65536
            yield b"x" * 65536
        yield b'"}]}'

    reply = httpx.post(
        f"{gateway.http_url}/v1/chat/completions",
        content=chunks(),
        headers={"Authorization": f"Bearer {TENANT_KEY}", "Content-Type": "application/json"},
        timeout=60,
    )
    assert "content-length" not in {k.lower() for k in reply.request.headers if k.lower() != "content-type"}
    _assert_openai_error(reply, 413)
    assert httpx.get(f"{gateway.http_url}/healthz", timeout=10).status_code == 200


def test_every_other_http_server_has_the_limit_too(
    scheduler: ServiceProcess, eval_service: ServiceProcess
) -> None:
    """Services without an OpenAI API answer 413 in the kit's own error format, on any path."""
    for process in (scheduler, eval_service):
        reply = httpx.post(f"{process.http_url}/healthz", content=b"x" * HUGE, timeout=60)
        assert reply.status_code == 413, reply.text[:300]
        assert reply.json()["error"]["code"] == "request_too_large"


# -- nesting ---------------------------------------------------------------------------------------

#: The report's body: 100,000 levels of arrays (Python's parser recursed until RecursionError: 500).
DEEP = 100_000


def _deep_chat() -> bytes:
    return b'{"model": "llama", "messages": ' + b"[" * DEEP + b"]" * DEEP + b"}"


@pytest.mark.parametrize("target", ["gateway", "model_server"])
def test_a_100000_level_nested_body_is_400_naming_the_limit(
    target: str, request: pytest.FixtureRequest
) -> None:
    process: ServiceProcess = request.getfixturevalue(target)
    key = TENANT_KEY if target == "gateway" else MODEL_SERVER_TOKEN
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    for content in (_deep_chat(), iter([_deep_chat()])):  # with a length, and chunked
        reply = httpx.post(
            f"{process.http_url}/v1/chat/completions", content=content, headers=headers, timeout=60
        )
        error = _assert_openai_error(reply, 400)
        assert "deeper than 64 levels" in str(error["message"]), error
    # Nesting inside strings is text, not structure.
    reply = httpx.post(
        f"{process.http_url}/v1/chat/completions",
        content=json.dumps(_chat(messages=[{"role": "user", "content": "[" * 5000}])).encode(),
        headers=headers,
        timeout=60,
    )
    assert reply.status_code != 400 or "levels" not in reply.text, reply.text[:300]
    assert httpx.get(f"{process.http_url}/healthz", timeout=10).status_code == 200


def test_every_other_http_server_refuses_deep_json_too(
    scheduler: ServiceProcess, eval_service: ServiceProcess
) -> None:
    for process in (scheduler, eval_service):
        reply = httpx.post(
            f"{process.http_url}/healthz",
            content=b"[" * DEEP + b"]" * DEEP,
            headers={"Content-Type": "application/json"},
            timeout=60,
        )
        assert reply.status_code == 400, reply.text[:300]
        assert "deeper than 64 levels" in reply.json()["error"]["message"]


# -- tokenization off the event loop --------------------------------------------------------------


async def _health_latencies_during(url: str, send: asyncio.Task[httpx.Response]) -> list[float]:
    latencies = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as probe:
        while not send.done():
            started = time.monotonic()
            assert (await probe.get("/healthz")).status_code == 200
            latencies.append(time.monotonic() - started)
            await asyncio.sleep(0.02)
    return latencies


def test_a_long_chat_does_not_freeze_the_model_server_while_it_is_tokenized(
    model_server: ServiceProcess,
) -> None:
    """Six megabytes of chat (under the model server's 8 MiB limit) take seconds to tokenize;
    probes and other requests must still be answered meanwhile. Relative bound (load-proof): the slowest probe waits well under the time
    the tokenization took, where on the event loop it waited for all of it."""
    content = "To be, or not to be, that is the question. " * (6_000_000 // 44)
    body = json.dumps(_chat(messages=[{"role": "user", "content": content}])).encode()

    async def run() -> tuple[httpx.Response, float, list[float]]:
        async with httpx.AsyncClient(base_url=model_server.http_url, timeout=120) as client:
            started = time.monotonic()
            send = asyncio.create_task(
                client.post(
                    "/v1/chat/completions",
                    content=body,
                    headers={
                        "Authorization": f"Bearer {MODEL_SERVER_TOKEN}",
                        "Content-Type": "application/json",
                    },
                )
            )
            await asyncio.sleep(0.3)  # the body is uploaded and being tokenized
            latencies = await _health_latencies_during(model_server.http_url, send)
            reply = await send
            return reply, time.monotonic() - started, latencies

    reply, took, latencies = asyncio.run(run())
    # Far past the tiny model's context: refused once counted, after the tokenization.
    error = _assert_openai_error(reply, 400)
    assert "context" in str(error["message"])
    assert took > 1.0, f"tokenizing took {took:.2f}s: too fast to tell a frozen loop from a free one"
    assert latencies, "no probe got through while the request ran"
    print(f"\ntokenization request {took:.2f}s; {len(latencies)} probes, slowest {max(latencies):.3f}s")
    assert max(latencies) < took / 3, f"a probe waited {max(latencies):.2f}s of the {took:.2f}s request"


# -- numbers --------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["gateway", "model_server"])
def test_seeds_outside_0_to_2_63_are_400_naming_seed(target: str, request: pytest.FixtureRequest) -> None:
    process: ServiceProcess = request.getfixturevalue(target)
    client = _openai(process, TENANT_KEY if target == "gateway" else MODEL_SERVER_TOKEN)
    for seed in (2**63, 2**64, 2**80, -1):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "To be"}], max_tokens=2, seed=seed
            )
        assert refused.value.status_code == 400
        assert "seed" in str(refused.value.body), refused.value.body
    # The largest seed is still served.
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "To be"}], max_tokens=2, seed=2**63 - 1
    )
    assert reply.choices[0].finish_reason == "length"


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_nan_and_infinity_literals_are_refused_by_the_gateway(
    gateway: ServiceProcess, field: str, literal: str
) -> None:
    """Python's ``json`` reads ``NaN`` and ``Infinity``; no such number reaches a sampling field
    (nor is relayed upstream for the model server to trip on)."""
    body = json.dumps(_chat()).encode()[:-1] + f', "{field}": {literal}}}'.encode()
    reply = httpx.post(
        f"{gateway.http_url}/v1/chat/completions",
        content=body,
        headers={"Authorization": f"Bearer {TENANT_KEY}", "Content-Type": "application/json"},
        timeout=30,
    )
    error = _assert_openai_error(reply, 400)
    assert literal.lstrip("-") in str(error["message"])


@pytest.mark.parametrize("literal", ["NaN", "Infinity"])
def test_rag_timeout_s_nan_is_refused(gateway: ServiceProcess, literal: str) -> None:
    body = f'{{"query": "q", "collection": "docs", "model": "llama", "timeout_s": {literal}}}'
    reply = httpx.post(
        f"{gateway.http_url}/v1/rag/query",
        content=body.encode(),
        headers={"Authorization": f"Bearer {TENANT_KEY}", "Content-Type": "application/json"},
        timeout=30,
    )
    _assert_openai_error(reply, 400)


def test_model_server_refuses_non_finite_and_out_of_range_numbers(model_server: ServiceProcess) -> None:
    """Straight to the model server (no gateway in front): NaN and infinity literals in the
    sampling fields, and integers past what the engine takes."""
    auth = {"Authorization": f"Bearer {MODEL_SERVER_TOKEN}", "Content-Type": "application/json"}
    raw = json.dumps(_chat()).encode()[:-1]
    cases = [(b', "top_p": NaN}', "top_p"), (b', "temperature": Infinity}', "temperature")]
    cases += [(f', "priority": {2**70}}}'.encode(), "priority"), (f', "seed": {2**64}}}'.encode(), "seed")]
    # Each stop string is searched for after every token: 10,000 of them, or one of a megabyte.
    cases += [(b', "stop": ' + json.dumps([f"s{i}" for i in range(10_000)]).encode() + b"}", "stop")]
    cases += [(b', "stop": ["' + b"s" * (1 << 20) + b'"]}', "stop")]
    for extra, field in cases:
        reply = httpx.post(
            f"{model_server.http_url}/v1/chat/completions", content=raw + extra, headers=auth, timeout=30
        )
        error = _assert_openai_error(reply, 400)
        assert field in str(error["param"]) + str(error["message"]), error


def test_set_quota_refuses_a_weight_that_is_not_a_finite_share(scheduler: ServiceProcess) -> None:
    with grpc.insecure_channel(scheduler.grpc_target) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        auth = [("authorization", f"Bearer {SERVICE_TOKEN}")]
        # The team exists, so the weight gets as far as the database (NaN used to fail there).
        stub.CreateTeam(scheduler_pb2.CreateTeamRequest(name="research"), metadata=auth, timeout=30)
        for weight in (math.nan, math.inf, 1e300, -math.inf, -1.0):
            with pytest.raises(grpc.RpcError) as refused:
                stub.SetQuota(
                    scheduler_pb2.SetQuotaRequest(
                        team="research",
                        quota=scheduler_pb2.Quota(gpu_type="H100", guaranteed_gpus=1, weight=weight),
                    ),
                    metadata=auth,
                    timeout=30,
                )
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (weight, refused.value.details())
            assert "weight" in (refused.value.details() or "")


def test_submit_job_refuses_10000_labels(scheduler: ServiceProcess) -> None:
    with grpc.insecure_channel(scheduler.grpc_target) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        auth = [("authorization", f"Bearer {SERVICE_TOKEN}")]
        stub.CreateTeam(scheduler_pb2.CreateTeamRequest(name="labels"), metadata=auth, timeout=30)
        spec = scheduler_pb2.JobSpec(
            name="many-labels",
            team="labels",
            priority_class="normal",
            command=["python", "-c", "pass"],
            labels={f"k{i}": "v" for i in range(10_000)},
        )
        with pytest.raises(grpc.RpcError) as refused:
            stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec), metadata=auth, timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert "labels" in (refused.value.details() or "")


# -- names, paths, labels -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model",
    ["llama\r\nx-injected: 1", "llama\nx", "ll\x00ama", "llama\x7f", "x" * (1 << 20), "lla ma", "llamä"],
    ids=["crlf", "lf", "nul", "del", "1mb", "space", "non-ascii"],
)
def test_a_model_name_unfit_for_a_header_is_400_and_never_echoed(gateway: ServiceProcess, model: str) -> None:
    with httpx.Client(base_url=gateway.http_url, timeout=30) as client:
        reply = client.post(
            "/v1/chat/completions", json=_chat(model=model), headers={"Authorization": f"Bearer {TENANT_KEY}"}
        )
        error = _assert_openai_error(reply, 400)
        assert error["param"] == "model"
        assert "x-forge-model" not in reply.headers and "x-injected" not in reply.headers
        # The connection survived: the next request on it is answered.
        assert client.get("/healthz").status_code == 200


def test_the_model_server_refuses_unfit_model_names_too(model_server: ServiceProcess) -> None:
    for model in ("ll\x00ama", "x" * (1 << 20)):
        reply = httpx.post(
            f"{model_server.http_url}/v1/completions",
            json={"model": model, "prompt": "To be", "max_tokens": 2},
            headers={"Authorization": f"Bearer {MODEL_SERVER_TOKEN}"},
            timeout=30,
        )
        assert _assert_openai_error(reply, 400)["param"] == "model"


def test_register_model_path_too_long_or_with_control_characters_is_400(model_server: ServiceProcess) -> None:
    for path in ("/" + "a" * (1 << 20), "/tmp/" + "b" * 300 + "/model", "/tmp/a\x00b", "/tmp/a\nb"):
        reply = httpx.post(
            f"{model_server.http_url}/admin/v1/models",
            json={"name": "attack", "path": path},
            headers={"Authorization": f"Bearer {MODEL_SERVER_TOKEN}"},
            timeout=30,
        )
        assert _assert_openai_error(reply, 400)["param"] == "path", path[:40]


def _register(eval_service: ServiceProcess, name: str, uri: str, labels: dict[str, str]) -> grpc.RpcError:
    with grpc.insecure_channel(eval_service.grpc_target) as channel:
        stub = eval_pb2_grpc.EvalServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.RegisterModel(
                eval_pb2.RegisterModelRequest(ref=common_pb2.ModelRef(name=name), uri=uri, labels=labels),
                metadata=[("authorization", f"Bearer {SERVICE_TOKEN}")],
                timeout=30,
            )
    return refused.value


def test_register_model_refuses_a_1_mb_uri(eval_service: ServiceProcess) -> None:
    refused = _register(eval_service, "big-uri", "s3://bucket/" + "u" * (1 << 20), {})
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "uri" in (refused.details() or "")
    # Past the gRPC receive limit (4 MiB): refused before any handler runs.
    refused = _register(eval_service, "huge-uri", "s3://bucket/" + "u" * (5 << 20), {})
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_register_model_refuses_10000_labels_and_oversize_labels(eval_service: ServiceProcess) -> None:
    many = {f"k{i}": "v" for i in range(10_000)}
    for labels in (many, {"k" * 1000: "v"}, {"k": "v" * 100_000}, {"k": "a\x00b"}):
        refused = _register(eval_service, "labelled", "s3://bucket/model", labels)
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.details()
        assert "labels" in (refused.details() or "")
