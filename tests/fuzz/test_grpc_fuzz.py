"""Fuzz every RPC of the services with hypothesis-generated requests on real servers: a request
may be refused (INVALID_ARGUMENT, NOT_FOUND, …) but never answered with INTERNAL/UNKNOWN, and the
service must still be healthy afterwards.

``FORGE_FUZZ_EXAMPLES`` sets the requests per RPC: a few dozen in ``make test``, 1000 or more in
``make fuzz``.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from forge.rerank.v1 import rerank_pb2
from forge.scheduler.v1 import scheduler_pb2
from forge.trainer.v1 import trainer_pb2
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings

from forge_kit.grpckit import check_health
from forge_kit.testing import ServiceProcess
from forge_kit.testing.fuzz import SERVER_FAULTS, messages, unary_caller

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(int(os.environ.get("FORGE_FUZZ_TIMEOUT_S", "600"))),
]
EXAMPLES = int(os.environ.get("FORGE_FUZZ_EXAMPLES", "20"))
TOKEN = "fuzz-token"

#: service module -> (env prefix, proto service descriptor, RPCs left out and why)
TARGETS = {
    "forge_scheduler": (
        "FORGE_SCHEDULER_",
        scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"],
        {"AgentSession": "bidirectional; fuzzed through its first message in the scheduler's own tests"},
    ),
    "forge_reranker": ("FORGE_RERANKER_", rerank_pb2.DESCRIPTOR.services_by_name["RerankerService"], {}),
    "forge_trainer_agent": (
        "FORGE_TRAINER_AGENT_",
        trainer_pb2.DESCRIPTOR.services_by_name["TrainerAgentService"],
        {},
    ),
}


@pytest.fixture(scope="module", params=sorted(TARGETS))
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    module = request.param
    prefix = TARGETS[module][0]
    data = tmp_path_factory.mktemp(module)
    env = {
        f"{prefix}GRPC_PORT": "0",
        f"{prefix}HTTP_PORT": "0",
        f"{prefix}DATA_DIR": str(data),
        f"{prefix}KAFKA_ENABLED": "false",
        f"{prefix}AUTH_TOKEN": TOKEN,
    }
    if module == "forge_trainer_agent":
        env["FORGE_TRAINER_AGENT_SCHEDULER_TARGET"] = "127.0.0.1:1"
    process = ServiceProcess(module, env=env, log_path=str(Path(data) / "service.log"), cwd=str(data)).start()
    yield process
    process.stop()


def _methods(module: str) -> list[str]:
    _, service, excluded = TARGETS[module]
    return [m.name for m in service.methods if m.name not in excluded and not m.client_streaming]


def fuzz_method(channel: grpc.Channel, service: Any, name: str, statuses: Counter[str]) -> None:
    """Send ``EXAMPLES`` generated requests to one RPC, counting the statuses."""
    method = service.methods_by_name[name]
    call = unary_caller(channel, service, method, TOKEN)

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(messages(method.input_type))
    def fuzz(request: Message) -> None:
        code = call(request)
        statuses[f"{name}:{code.name}"] += 1
        assert code not in SERVER_FAULTS, f"{name} answered {code.name} to {request}"

    fuzz()


def test_fuzzed_requests_never_get_a_server_error(server: ServiceProcess) -> None:
    module = server.module
    _, service, _ = TARGETS[module]
    statuses: Counter[str] = Counter()
    with grpc.insecure_channel(server.grpc_target) as channel:
        for name in _methods(module):
            fuzz_method(channel, service, name, statuses)
    # Hypothesis stops early only when a request type has fewer distinct values (an empty message).
    exercised = {key.split(":")[0] for key in statuses}
    assert exercised == set(_methods(module))
    assert asyncio.run(check_health(server.grpc_target)), f"{module} unhealthy after fuzzing"
    print(f"\n{module}: {sum(statuses.values())} fuzzed requests: {dict(sorted(statuses.items()))}")
