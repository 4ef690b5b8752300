"""The gateway's OpenAPI document against the gateway itself: schemathesis generates requests from
the document (valid and invalid), sends them to a live gateway on a port, and checks every answer
against what the document says (documented status, content type, response schema, no 5xx, 401
without a key, 405 for an undeclared method, invalid data refused)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import positive_data_acceptance

from forge_inference_gateway.openai_api import install_gateway_api
from forge_kit.db import Database
from forge_kit.http import HttpServer, make_app

from .conftest import ADMIN_TOKEN, API_KEY, MIGRATIONS, ProtocolReplica, build_gateway

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def live_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A gateway over one protocol replica, served on a free port from its own thread and loop
    (schemathesis calls it synchronously)."""
    db_path = tmp_path_factory.mktemp("openapi") / "gateway.db"
    started = threading.Event()
    state: dict[str, object] = {}

    async def main() -> None:
        replica = await ProtocolReplica().start()
        db = Database(f"sqlite+aiosqlite:///{db_path}")
        await db.migrate(MIGRATIONS)
        gateway = build_gateway(db, [replica.url], default_rpm_limit=1_000_000)
        await gateway.tenants.bootstrap(API_KEY)
        app = make_app("inference_gateway")
        install_gateway_api(app, gateway, ADMIN_TOKEN)
        server = HttpServer(app, "127.0.0.1", 0)
        await server.start()
        stop = asyncio.Event()
        state.update(url=f"http://127.0.0.1:{server.port}", stop=stop, loop=asyncio.get_running_loop())
        started.set()
        await stop.wait()
        await server.stop()
        await gateway.replicas.stop()
        await replica.stop()
        await db.dispose()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(30), "the gateway did not start"
    yield str(state["url"])
    loop, stop = state["loop"], state["stop"]
    assert isinstance(loop, asyncio.AbstractEventLoop) and isinstance(stop, asyncio.Event)
    loop.call_soon_threadsafe(stop.set)
    thread.join(30)


@pytest.fixture(scope="module")
def gateway_schema(live_gateway: str) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{live_gateway}/openapi.json")


def test_the_document_describes_bodies_security_and_statuses(gateway_schema: schemathesis.BaseSchema) -> None:
    doc = gateway_schema.raw_schema
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("ChatCompletionBody")
    assert {"400", "401", "429"} <= set(chat["responses"]) and "422" not in chat["responses"]
    assert doc["components"]["securitySchemes"]["HTTPBearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "A tenant API key (``/v1``) or the admin token.",
    }
    assert "201" in doc["paths"]["/admin/v1/tenants"]["post"]["responses"]
    assert all("422" not in op["responses"] for path in doc["paths"].values() for op in path.values())


# Rules across fields (min_tokens at most max_tokens, logit_bias ids, image parts no served
# model reads) are not expressible in the schema: a schema-valid body may still get a documented
# 400, so "valid data is accepted" is not checked; everything else is.

#: Admin routes that change the replica set or aliases would take the gateway's only replica away.
_SKIPPED = (
    "/admin/v1/replicas",
    "/admin/v1/aliases/{alias}/canary",
    "/admin/v1/aliases/{alias}",
    "/admin/v1/aliases/{alias}/shadow",
)


def _checker(operation: schemathesis.APIOperation, mode: schemathesis.GenerationMode) -> Callable[[], None]:
    token = ADMIN_TOKEN if operation.path.startswith("/admin") else API_KEY

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=6, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def check(case: schemathesis.Case) -> None:
        case.call_and_validate(
            headers={"Authorization": f"Bearer {token}"},
            excluded_checks=[positive_data_acceptance],
            timeout=30,
        )

    return check


@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode))
def test_the_gateway_answers_as_its_document_says(
    gateway_schema: schemathesis.BaseSchema, mode: schemathesis.GenerationMode
) -> None:
    """A few generated cases per operation (the pytest plugin of schemathesis does not run under
    this pytest, so hypothesis drives each operation's strategy here)."""
    tested = []
    for result in gateway_schema.get_all_operations():
        operation = result.ok()
        if operation.path in _SKIPPED:
            continue
        _checker(operation, mode)()
        tested.append(f"{operation.method.upper()} {operation.path}")
    assert "POST /v1/chat/completions" in tested and "GET /v1/models/{model_id}" in tested
