"""Freshness through the Kafka path: a document changed upstream, until Search finds it.

    python load/retrieval/bench_freshness.py [--updates 100] [--rate 5] [--dense] [--out FILE.json]

Starts the real Tansu broker and the real retriever process (``python -m forge_retriever``,
SQLite and Qdrant Edge in a temporary folder, BM25 only unless ``--dense``), then, as an upstream
source system would, publishes ``DocumentChanged`` UPSERTED events (producer ``bench-cms``) to
``forge.retrieval.document_changed.v1`` at ``--rate`` per second, open loop. Each update gives a
document text with a word never used before; a poller per update searches that word over gRPC
every 10 ms. Freshness of an update = from just before the publish call to the first Search that
returns the document — broker, consumer, chunking, encoding, the index write and the commit.
A warm-up event (not counted) first waits for the consumer group to form.

Prints one JSON line: count, p50/p95/max in ms, the target (p95 ≤ 2,000 ms) and
``"pass"``; exits 1 on a miss or a timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from forge.events.v1 import events_pb2
from forge.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc

from forge_kit.events import KafkaPublisher, ensure_topics, new_meta, topic_for
from forge_kit.grpckit import make_channel
from forge_kit.testing import eventkeys
from forge_kit.testing.processes import ServiceProcess, TansuBroker

TARGET_P95_MS = 2_000.0
TOKEN = "bench-retrieval-token"
COLLECTION = "fresh"
TOPIC = topic_for(events_pb2.DocumentChanged())


def _event(doc_id: str, word: str, version: int) -> events_pb2.DocumentChanged:
    return events_pb2.DocumentChanged(
        meta=new_meta("bench-cms"),
        collection=COLLECTION,
        document_id=doc_id,
        change=events_pb2.DOCUMENT_CHANGE_TYPE_UPSERTED,
        version=version,
        title=f"Page {doc_id}",
        text=f"This page was edited upstream and now mentions {word} among ordinary words. " * 3,
        metadata={"source": "bench-cms"},
    )


async def _visible(stub: retrieval_pb2_grpc.RetrieverServiceAsyncStub, word: str, doc_id: str) -> bool:
    try:
        response = await stub.Search(
            retrieval_pb2.SearchRequest(
                collection=COLLECTION, query=word, top_k=3, mode=retrieval_pb2.SEARCH_MODE_SPARSE
            ),
            timeout=2.0,
        )
    except Exception:  # noqa: BLE001 - the collection does not exist before the first apply
        return False
    return any(c.document_id == doc_id for c in response.chunks)


async def _update(
    publisher: KafkaPublisher,
    stub: retrieval_pb2_grpc.RetrieverServiceAsyncStub,
    doc_id: str,
    version: int,
    timeout_s: float,
) -> float:
    """Publish one update and return ms until Search finds it (``inf`` on timeout)."""
    word = f"w{uuid.uuid4().hex[:12]}"
    started = time.monotonic()
    await publisher.publish(_event(doc_id, word, version), key=f"{COLLECTION}/{doc_id}")
    while time.monotonic() - started < timeout_s:
        if await _visible(stub, word, doc_id):
            return (time.monotonic() - started) * 1000.0
        await asyncio.sleep(0.01)
    return float("inf")


async def run(args: argparse.Namespace) -> dict[str, object]:
    work = Path(tempfile.mkdtemp(prefix="forge-freshness-"))
    broker = TansuBroker(log_path=str(work / "broker.log")).start()
    retriever: ServiceProcess | None = None
    try:
        await ensure_topics(broker.bootstrap)
        env = {
            "FORGE_RETRIEVER_DATA_DIR": str(work / "data"),
            "FORGE_RETRIEVER_KAFKA_BOOTSTRAP": broker.bootstrap,
            "FORGE_RETRIEVER_AUTH_TOKEN": TOKEN,
            "FORGE_RETRIEVER_DENSE_ENABLED": "true" if args.dense else "false",
            "FORGE_RETRIEVER_EMBEDDING_THREADS": "1",
            # bench-cms is an upstream source the retriever is told to trust, with its own key.
            "FORGE_RETRIEVER_DOCUMENT_SOURCES": '["bench-cms"]',
            **eventkeys.service_env("retriever", extra=["bench-cms"]),
        }
        retriever = ServiceProcess("forge_retriever", env=env, log_path=str(work / "retriever.log")).start(
            120
        )
        publisher = KafkaPublisher(broker.bootstrap, signer=eventkeys.signer("bench-cms"))
        async with make_channel(retriever.grpc_target, token=TOKEN) as channel:
            stub: retrieval_pb2_grpc.RetrieverServiceAsyncStub = retrieval_pb2_grpc.RetrieverServiceStub(
                channel
            )  # type: ignore[assignment]
            # 1. Warm-up: wait for the consumer group to form and apply a first event.
            if await _update(publisher, stub, "warm-up", 1, timeout_s=60.0) == float("inf"):
                raise TimeoutError("the retriever never applied the warm-up event (consumer not joined?)")
            # 2. Open loop: one update every 1/rate s, each over its own document, each timed.
            tasks = []
            for i in range(args.updates):
                tasks.append(
                    asyncio.create_task(
                        _update(publisher, stub, f"doc-{i % args.documents}", i + 2, args.timeout_s)
                    )
                )
                await asyncio.sleep(1.0 / args.rate)
            latencies = await asyncio.gather(*tasks)
        await publisher.close()
    finally:
        if retriever is not None:
            retriever.stop()
        broker.stop()
    done = sorted(x for x in latencies if x != float("inf"))
    timeouts = len(latencies) - len(done)
    p95 = done[max(0, math.ceil(0.95 * len(done)) - 1)] if done else float("inf")
    return {
        "updates": len(latencies),
        "rate_per_s": args.rate,
        "dense": args.dense,
        "timeouts": timeouts,
        "p50_ms": round(statistics.median(done), 1) if done else None,
        "p95_ms": round(p95, 1),
        "max_ms": round(done[-1], 1) if done else None,
        "target_p95_ms": TARGET_P95_MS,
        "pass": timeouts == 0 and p95 <= TARGET_P95_MS,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--updates", type=int, default=100, help="timed updates")
    parser.add_argument("--rate", type=float, default=5.0, help="updates published per second (open loop)")
    parser.add_argument("--documents", type=int, default=20, help="distinct documents the updates cycle over")
    parser.add_argument("--dense", action="store_true", help="embed with MiniLM too (the service default)")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="give up on one update after this")
    parser.add_argument("--out", type=Path, help="also write the JSON result here")
    args = parser.parse_args()
    if args.updates < 1 or args.rate <= 0 or args.documents < 1:
        parser.error("--updates and --documents must be at least 1 and --rate above 0")
    result = asyncio.run(run(args))
    line = json.dumps(result)
    print(line)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(line + "\n")
    with contextlib.suppress(BrokenPipeError):
        sys.stdout.flush()
    sys.exit(0 if result["pass"] else 1)


if __name__ == "__main__":
    main()
