"""Fuzz the public OpenAI-compatible HTTP API with schemathesis, from the gateway's own OpenAPI
schema, on real processes (the gateway in front of a real model server): whatever the body,
the answer is a 4xx or a success — never a 500 — and the gateway stays healthy.

``FORGE_FUZZ_EXAMPLES`` sets the requests per operation (a few dozen in ``make test``).
"""

from __future__ import annotations

import os
import urllib.request
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from forge_kit.testing import ServiceProcess, base_env

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(int(os.environ.get("FORGE_FUZZ_TIMEOUT_S", "900"))),
]
EXAMPLES = int(os.environ.get("FORGE_FUZZ_EXAMPLES", "20"))
TENANT_KEY = "fk-fuzz-tenant-key"
MODEL_SERVER_TOKEN = "fuzz-model-server-token"
GATEWAY_ADMIN_TOKEN = "fuzz-gateway-admin-token"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    data = tmp_path_factory.mktemp("http-fuzz")
    upstream = ServiceProcess(
        "forge_model_server",
        env=base_env(
            "model_server", token=MODEL_SERVER_TOKEN, data_dir=data / "ms", models_dir=str(data / "models")
        ),
        log_path=str(data / "model_server.log"),
        cwd=str(data),
    ).start()
    gateway = ServiceProcess(
        "forge_inference_gateway",
        env=base_env(
            "inference_gateway",
            token=GATEWAY_ADMIN_TOKEN,
            data_dir=data / "gw",
            model_server_url=upstream.http_url,
            model_server_token=MODEL_SERVER_TOKEN,
            bootstrap_api_key=TENANT_KEY,
            default_rpm_limit="1000000",
        ),
        log_path=str(data / "gateway.log"),
        cwd=str(data),
    ).start()
    yield gateway
    gateway.stop()
    upstream.stop()


def fuzz_operation(operation: Any, base_url: str, statuses: Counter[str]) -> None:
    """``EXAMPLES`` generated requests to one operation of the schema, as the tenant on the public
    API and as the admin on ``/admin/*`` (so the handlers behind authentication are reached)."""
    token = GATEWAY_ADMIN_TOKEN if operation.path.startswith("/admin/") else TENANT_KEY

    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy())
    def fuzz(case: schemathesis.Case) -> None:
        response = case.call(base_url=base_url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
        statuses[f"{case.method} {case.path} {response.status_code}"] += 1
        assert response.status_code != 500, (
            f"{case.method} {case.path}: 500 for {case.body!r}: {response.text[:300]}"
        )

    fuzz()


def test_no_generated_request_gets_a_server_error(gateway: ServiceProcess) -> None:
    schema = schemathesis.openapi.from_url(f"{gateway.http_url}/openapi.json")
    statuses: Counter[str] = Counter()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert operations
    for operation in operations:
        fuzz_operation(operation, gateway.http_url, statuses)
    with urllib.request.urlopen(f"{gateway.http_url}/healthz", timeout=5) as health:
        assert health.status == 200
    exercised = {key.rsplit(" ", 1)[0] for key in statuses}
    assert len(exercised) == len(operations)
    print(f"\ngateway HTTP: {sum(statuses.values())} fuzzed requests: {dict(sorted(statuses.items()))}")


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
_near_valid_chat = st.fixed_dictionaries(
    {"model": st.sampled_from(["tiny", "forge-chat", "", "../x"])},
    optional={
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "bot", ""]), "content": _json}),
            max_size=3,
        ),
        "max_tokens": _json,
        "temperature": _json,
        "top_p": _json,
        "stream": _json,
        "stop": _json,
        "n": _json,
    },
)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_arbitrary_json_bodies_never_get_a_server_error(gateway: ServiceProcess, path: str) -> None:
    """Beyond what the OpenAPI schema describes, bodies are generated here too: arbitrary JSON,
    and requests that are nearly valid with wrong types and values in every field."""
    statuses: Counter[int] = Counter()
    with httpx.Client(base_url=gateway.http_url, timeout=30) as client:

        @settings(
            max_examples=EXAMPLES * 5, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        @given(st.one_of(_json, _near_valid_chat))
        # Issue 22's inputs that hurt, every run: huge integers, control characters and a megabyte
        # where a name goes (the gateway echoes the model in a header).
        @example({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "seed": 2**64})
        @example({"model": "tiny", "prompt": "hi", "seed": 2**63, "max_tokens": 10**30, "priority": 2**70})
        @example({"model": "tiny\r\nx-injected: 1", "prompt": "hi"})
        @example({"model": "ti\x00ny", "messages": [{"role": "user", "content": "hi"}]})
        @example({"model": "x" * (1 << 20), "prompt": "hi"})
        def fuzz(body: object) -> None:
            response = client.post(path, json=body, headers={"Authorization": f"Bearer {TENANT_KEY}"})
            statuses[response.status_code] += 1
            assert response.status_code != 500, f"500 for {body!r}: {response.text[:300]}"

        fuzz()
        assert client.get("/healthz").status_code == 200
    print(f"\n{path}: {sum(statuses.values())} fuzzed bodies: {dict(sorted(statuses.items()))}")


_CHAT = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]'
#: Bodies a JSON encoder would not write: Python's ``json`` reads NaN and Infinity literals.
_NON_FINITE = [
    _CHAT + f', "{field}": {literal}}}'.encode()
    for field in ("temperature", "top_p", "max_tokens", "seed")
    for literal in ("NaN", "Infinity", "-Infinity")
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/rag/query"])
def test_non_finite_literals_and_oversize_bodies_are_refused(gateway: ServiceProcess, path: str) -> None:
    """NaN/Infinity literals in every numeric field are 400; a body past the limit is 413, with or
    without a Content-Length; the gateway stays healthy."""
    auth = {"Authorization": f"Bearer {TENANT_KEY}", "Content-Type": "application/json"}
    oversize = _CHAT + b', "x": "' + b"x" * (5 << 20) + b'"}'
    with httpx.Client(base_url=gateway.http_url, timeout=60) as client:
        for body in _NON_FINITE:
            reply = client.post(path, content=body, headers=auth)
            assert reply.status_code == 400, f"{reply.status_code} for {body!r}: {reply.text[:300]}"
        assert client.post(path, content=oversize, headers=auth).status_code == 413
        chunked = client.post(
            path,
            content=iter([oversize[i : i + 65536] for i in range(0, len(oversize), 65536)]),
            headers=auth,
        )
        assert chunked.status_code == 413
        assert client.get("/healthz").status_code == 200


FEEDBACK_ADMIN_PASSWORD = "fuzz-admin-password-1"


@pytest.fixture(scope="module")
def feedback(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServiceProcess, str]]:
    """The preference service with its admin account, and a session token of that admin (so the
    fuzzed requests reach past authentication into every handler)."""
    data = tmp_path_factory.mktemp("http-fuzz-feedback")
    process = ServiceProcess(
        "forge_preference_feedback",
        env=base_env(
            "preference_feedback",
            token="fuzz-feedback-token",
            data_dir=data,
            admin_password=FEEDBACK_ADMIN_PASSWORD,
        ),
        log_path=str(data / "service.log"),
        cwd=str(data),
    ).start()
    login = httpx.post(
        f"{process.http_url}/api/v1/sessions",
        json={"rater_id": "admin", "password": FEEDBACK_ADMIN_PASSWORD},
        timeout=30,
    )
    assert login.status_code == 200, login.text
    yield process, str(login.json()["token"])
    process.stop()


def test_no_generated_rater_api_request_gets_a_server_error(feedback: tuple[ServiceProcess, str]) -> None:
    """The rater and reward-model JSON API, from the service's OpenAPI schema, as a logged-in
    admin: every operation is reached with generated paths, queries and bodies."""
    process, token = feedback
    schema = schemathesis.openapi.from_url(f"{process.http_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert any(op.path.startswith("/api/v1/") for op in operations)
    statuses: Counter[str] = Counter()
    for operation in operations:

        @settings(
            max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        @given(operation.as_strategy())
        def fuzz(case: schemathesis.Case) -> None:
            response = case.call(
                base_url=process.http_url, headers={"Authorization": f"Bearer {token}"}, timeout=30
            )
            statuses[f"{case.method} {case.path} {response.status_code}"] += 1
            assert response.status_code < 500, (
                f"{case.method} {case.path}: {response.status_code} for {case.body!r}: {response.text[:300]}"
            )

        fuzz()
    with urllib.request.urlopen(f"{process.http_url}/healthz", timeout=5) as health:
        assert health.status == 200
    print(f"\nfeedback HTTP: {sum(statuses.values())} fuzzed requests: {dict(sorted(statuses.items()))}")
