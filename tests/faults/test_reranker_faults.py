"""kill -9 of the reranker under load.

Clients send the same few rerank requests over and over; the reranker is killed with SIGKILL mid-run
and started again in place. A call that fails while it is down is sent again, as the gateway's
RAG path does. Afterwards: every request was answered, the only errors clients saw were
``UNAVAILABLE`` (nothing half-answered, no internal error), and each request's ranking and scores
after the restart equal those before it (the score cache is lost with the process; the model scores
the same), with the recovery time printed.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest
from fault_platform import wait_ready
from forge.rerank.v1 import rerank_pb2, rerank_pb2_grpc

from forge_kit.grpckit import make_channel
from forge_kit.testing import ServiceProcess, base_env, free_port

pytestmark = [pytest.mark.integration, pytest.mark.faults_full, pytest.mark.timeout(300)]
TOKEN = "faults-reranker-token"
CLIENTS = 3
CALLS_PER_CLIENT = 60
QUERIES = [
    (
        "who wrote hamlet",
        ["Hamlet is a tragedy by William Shakespeare.", "Paris is in France.", "Hamlets are villages."],
    ),
    (
        "capital of france",
        ["Lyon is a city in France.", "Paris is the capital of France.", "Rome is in Italy."],
    ),
    ("boiling point of water", ["Water boils at 100 degrees Celsius at sea level.", "Ice is frozen water."]),
]

Ranking = tuple[tuple[str, float], ...]


def request(n: int) -> rerank_pb2.RerankRequest:
    query, texts = QUERIES[n % len(QUERIES)]
    passages = [rerank_pb2.Passage(id=f"p{i}", text=t) for i, t in enumerate(texts)]
    return rerank_pb2.RerankRequest(query=query, passages=passages)


async def client(
    target: str, first: int, seen: dict[int, list[tuple[float, Ranking]]], errors: Counter[str]
) -> None:
    """Send ``CALLS_PER_CLIENT`` requests, each until it is answered; record each answer's ranking."""
    async with make_channel(target, token=TOKEN) as channel:
        stub = rerank_pb2_grpc.RerankerServiceStub(channel)
        for n in range(first, first + CALLS_PER_CLIENT):
            while True:
                try:
                    reply = await stub.Rerank(request(n), timeout=10)
                except grpc.aio.AioRpcError as exc:
                    errors[exc.code().name] += 1
                    await asyncio.sleep(0.1)
                    continue
                ranking = tuple((r.id, r.score) for r in reply.results)
                seen.setdefault(n % len(QUERIES), []).append((time.monotonic(), ranking))
                break


async def test_reranker_kill_answers_everything_the_same_after_restart(tmp_path: Path) -> None:
    reranker = ServiceProcess(
        "forge_reranker",
        env=base_env(
            "reranker",
            token=TOKEN,
            data_dir=tmp_path / "reranker",
            grpc_port=free_port(),
            http_port=free_port(),
        ),
        log_path=str(tmp_path / "reranker.log"),
    ).start(90)
    seen: dict[int, list[tuple[float, Ranking]]] = {}
    errors: Counter[str] = Counter()
    try:
        await asyncio.to_thread(wait_ready, reranker)
        clients = [
            asyncio.create_task(client(reranker.grpc_target, c * CALLS_PER_CLIENT, seen, errors))
            for c in range(CLIENTS)
        ]
        # 1. Kill -9 once a quarter is answered; start again in place.
        while sum(len(v) for v in seen.values()) < CLIENTS * CALLS_PER_CLIENT // 4:
            await asyncio.sleep(0.02)
        reranker.kill()
        killed = time.monotonic()
        await asyncio.to_thread(reranker.start, 90)
        await asyncio.to_thread(wait_ready, reranker)
        recovery = time.monotonic() - killed
        await asyncio.wait_for(asyncio.gather(*clients), timeout=180)
    finally:
        reranker.stop()
    print(f"\nfault reranker kill -9: recovered in {recovery:.1f}s; failed calls retried: {dict(errors)}")
    assert sum(len(v) for v in seen.values()) == CLIENTS * CALLS_PER_CLIENT
    assert set(errors) <= {"UNAVAILABLE"}, errors
    for query, answers in seen.items():
        before = {ranking for at, ranking in answers if at < killed}
        after = {ranking for at, ranking in answers if at > killed}
        assert before and after, query
        assert len(before | after) == 1, (query, before, after)  # one answer, before and after
    assert recovery <= 30
