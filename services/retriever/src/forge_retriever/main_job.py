"""The ``rag`` step of the platform main job (entry-point group ``forge.main_job``, order 75).

After the ``chat`` step has served the trained checkpoint through the gateway, this step runs the
RAG path end to end on real documents:

1. read a sample of NFCorpus (``beir/nfcorpus`` in the data folder: BEIR's own files, which
   ``forge data fetch`` can download as they are): the documents judged
   relevant to its first ``SAMPLE_QUERIES`` test queries, then corpus documents in file order up to
   ``SAMPLE_DOCS`` in all;
2. upsert them into the collection ``nfcorpus-sample`` through the retriever's gRPC API, for the
   tenant the gateway's key belongs to (``default``), in batches; a second ``forge up`` re-sends
   the same content, which the retriever treats as a no-op;
3. ask the first sampled query through the gateway's ``POST /v1/rag/query`` (streamed) with the
   model the ``chat`` step loaded: hybrid retrieval → rerank → context fitted to the model's window
   with its own tokenizer → a streamed answer with the numbered passages;
4. report what was ingested and how fast, the passages the model was given (document ids and
   titles), whether a document judged relevant to the query is among them, the answer, the
   passages it cites, and where the time went.

The main job's model is a few-minute Shakespeare model: its answer is not expected to be useful or
to cite anything; the step checks the path (retrieved, fitted, generated), and says what came back.
The step never imports the CLI or another service, only their contracts.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
from forge.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc

from forge_kit.grpckit import make_channel
from forge_kit.mainjob import Endpoint, MainJobContext
from forge_kit.paths import resolve_data_path
from forge_retriever.evaluation import load_beir

DATASET = "beir/nfcorpus"
COLLECTION = "nfcorpus-sample"
TENANT = "default"
"""The gateway's bootstrap tenant, which the main job's gateway key belongs to."""
SAMPLE_QUERIES = 3
SAMPLE_DOCS = 100
BATCH = 50
TOP_K, TOP_N, MAX_TOKENS = 20, 3, 48
RPC_S = 120.0
HTTP_S = 120.0


class RagStepError(RuntimeError):
    """A part of the rag step failed; the message says which and what the service answered."""


def sample(
    folder: Path, queries: int = SAMPLE_QUERIES, docs: int = SAMPLE_DOCS
) -> tuple[list[Any], str, set[str]]:
    """The documents to ingest, the question to ask and the ids judged relevant to it."""
    data = load_beir(folder)
    asked = list(data.qrels)[:queries]
    wanted = {d for q in asked for d, score in data.qrels[q].items() if score > 0}
    chosen = [d for d in data.corpus if d.id in wanted]
    chosen += [d for d in data.corpus if d.id not in wanted][: max(0, docs - len(chosen))]
    question = asked[0]
    relevant = {d for d, score in data.qrels[question].items() if score > 0}
    return chosen, data.queries[question], relevant


async def rag(ctx: MainJobContext) -> dict[str, object]:
    chat = ctx.results.get("chat") or {}
    model = chat.get("served_model")
    if not isinstance(model, str) or not model:
        raise RagStepError(
            "no served model to answer with: the `chat` step's result has no served_model "
            f"(steps that ran: {', '.join(ctx.results) or 'none'})"
        )
    # 1. The sample.
    folder = resolve_data_path(DATASET)
    documents, question, relevant = await asyncio.to_thread(sample, folder)
    # 2. Ingest through the retriever's API.
    retriever = ctx.endpoint("retriever")
    started = time.monotonic()
    chunks = 0
    async with make_channel(retriever.grpc_target, token=retriever.token) as channel:
        stub = retrieval_pb2_grpc.RetrieverServiceStub(channel)
        for at in range(0, len(documents), BATCH):
            request = retrieval_pb2.UpsertDocumentsRequest(
                collection=COLLECTION,
                documents=[
                    retrieval_pb2.Document(id=d.id, title=d.title, text=d.text)
                    for d in documents[at : at + BATCH]
                ],
            )
            reply = await stub.UpsertDocuments(request, timeout=RPC_S, metadata=(("forge-tenant", TENANT),))
            chunks += reply.chunk_count
    ingest_s = time.monotonic() - started
    # 3. Ask through the gateway.
    gateway = ctx.endpoint("inference_gateway")
    body = {
        "query": question,
        "collection": COLLECTION,
        "model": model,
        "top_k": TOP_K,
        "top_n": TOP_N,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.8,
        "stream": True,
    }
    asked = time.monotonic()
    answer = await _stream_rag(gateway, body)
    e2e_ms = (time.monotonic() - asked) * 1000
    # 4. Report.
    passages = answer.get("passages") or []
    found = [p["document_id"] for p in passages if p.get("document_id") in relevant]
    usage = answer.get("usage") or {}
    return {
        "ok": bool(passages) and int(usage.get("completion_tokens", 0)) > 0,
        "dataset": str(folder),
        "documents_ingested": len(documents),
        "chunks_written": chunks,
        "ingest_s": round(ingest_s, 2),
        "question": question,
        "passages": [
            f"[{p['n']}] {p['document_id']} {p.get('metadata', {}).get('title', '')[:60]}" for p in passages
        ],
        "relevant_retrieved": f"{len(found)} of {len(relevant)} judged relevant ({', '.join(found) or 'none'})",
        "answer": answer.get("answer", ""),
        "citations": [c["n"] for c in answer.get("citations") or []],
        "context_tokens": f"{(answer.get('context') or {}).get('tokens')} of {(answer.get('context') or {}).get('budget_tokens')}",
        "token_count": (answer.get("context") or {}).get("token_count"),
        "rerank": answer.get("rerank"),
        "retrieval_mode": (answer.get("retrieval") or {}).get("mode"),
        "timings_ms": {**(answer.get("timings_ms") or {}), "e2e": round(e2e_ms, 1)},
    }


rag.order = 75  # type: ignore[attr-defined]
rag.timeout_s = 300.0  # type: ignore[attr-defined]


async def _stream_rag(gateway: Endpoint, body: dict[str, object]) -> dict[str, Any]:
    """The final ``rag.answer`` event of a streamed RAG query; the deltas must add up to its answer."""
    deltas: list[str] = []
    final: dict[str, Any] | None = None
    headers = {"Authorization": f"Bearer {gateway.token}"}
    async with (
        httpx.AsyncClient(timeout=HTTP_S) as client,
        client.stream("POST", f"{gateway.http_url}/v1/rag/query", json=body, headers=headers) as reply,
    ):
        if reply.status_code != 200:
            raise RagStepError(f"the RAG query: HTTP {reply.status_code}: {(await reply.aread())[:500]!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                raise RagStepError(f"the RAG stream reported an error: {event['error']}")
            if event.get("object") == "rag.answer.delta":
                deltas.append(str(event.get("delta", "")))
            elif event.get("object") == "rag.answer":
                final = event
    if final is None:
        raise RagStepError("the RAG stream ended without its rag.answer event")
    if "".join(deltas) != final.get("answer", ""):
        raise RagStepError("the streamed deltas do not add up to the final answer")
    return final
