"""The driven scenarios: each starts its services, drives them for a while with a closed loop of
clients, and counts what it sent against what the services hold afterwards.

A scenario is used two ways: ``python -m load run`` drives it once and checks its figures against
``load/thresholds.toml``; ``python -m load soak`` drives all of them together for a set time and
watches memory and error rate (``soak.py``).
"""

from __future__ import annotations

import asyncio
import gzip
import itertools
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import grpc
from forge.common.v1 import common_pb2
from forge.rerank.v1 import rerank_pb2, rerank_pb2_grpc
from forge.retrieval.v1 import retrieval_pb2, retrieval_pb2_grpc
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

from forge_kit.grpckit import make_channel
from forge_kit.paths import resolve_data_path
from forge_kit.testing.processes import ServiceProcess

from . import services
from .measure import Tally

DEFAULT_BEIR = resolve_data_path("beir/scifact")


class Scenario(Protocol):
    name: str

    def start(self, work: Path) -> None: ...

    async def drive(self, seconds: float, tally: Tally) -> None: ...

    async def audit(self) -> dict[str, Any]: ...

    def processes(self) -> dict[str, ServiceProcess]: ...

    def stop(self) -> None: ...


def _error(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code().name
    return type(exc).__name__


class SchedulerApi:
    """Researchers submitting, reading, listing and cancelling jobs on one team.

    Each client: SubmitJob (a fresh request id), GetJob of it, every ``cancel_every``-th job a
    CancelJob (1 in the soak, so the queue stays the same size however long it runs), every 10th
    a ListJobs page. Afterwards every job listed for the team is matched against the ids the
    clients were given: none missing, none twice (``lost``, ``duplicated``).
    """

    name = "scheduler_api"

    def __init__(self, clients: int = 8, cancel_every: int = 5) -> None:
        self.clients, self.cancel_every = clients, cancel_every
        self.team = f"load-{uuid.uuid4().hex[:6]}"
        self.submitted: list[str] = []
        self._proc: ServiceProcess | None = None

    def start(self, work: Path) -> None:
        self._proc = services.scheduler(work)
        try:
            asyncio.run(self._create_team())
        except BaseException:
            self.stop()  # leave nothing running when the scenario cannot start
            raise

    async def _create_team(self) -> None:
        async with make_channel(self.target, token=services.TOKEN) as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            quota = scheduler_pb2.Quota(gpu_type="sim", guaranteed_gpus=64, borrow_limit=64, weight=1.0)
            await stub.CreateTeam(scheduler_pb2.CreateTeamRequest(name=self.team, quotas=[quota]), timeout=30)

    @property
    def target(self) -> str:
        assert self._proc is not None, "start() first"
        return self._proc.grpc_target

    async def drive(self, seconds: float, tally: Tally) -> None:
        deadline = time.monotonic() + seconds
        async with make_channel(self.target, token=services.TOKEN) as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            await asyncio.gather(*(self._client(stub, c, deadline, tally) for c in range(self.clients)))

    async def _client(
        self, stub: scheduler_pb2_grpc.SchedulerServiceStub, client: int, deadline: float, tally: Tally
    ) -> None:
        for n in itertools.count():
            if time.monotonic() >= deadline:
                return
            spec = scheduler_pb2.JobSpec(
                name=f"load-{client}-{n}",
                team=self.team,
                priority_class="normal",
                kind=scheduler_pb2.JOB_KIND_TRAINING,
                resources=common_pb2.ResourceRequest(
                    gpu_count=1 + n % 4, gpu_type="sim", cpu_millis=1000, memory_mb=1024
                ),
                replicas=1 + n % 2,
                command=["python", "-c", "pass"],
                max_runtime_seconds=3600,
            )
            job_id = await self._call(
                tally,
                "submit",
                stub.SubmitJob(
                    scheduler_pb2.SubmitJobRequest(spec=spec, request_id=str(uuid.uuid4())), timeout=30
                ),
            )
            if job_id is None:
                continue
            self.submitted.append(job_id)
            await self._call(
                tally, "get", stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id), timeout=30)
            )
            if n % self.cancel_every == self.cancel_every - 1:
                await self._call(
                    tally,
                    "cancel",
                    stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job_id, reason="load"), timeout=30),
                )
            if n % 10 == 9:
                page = common_pb2.PageRequest(page_size=100)
                await self._call(
                    tally,
                    "list",
                    stub.ListJobs(scheduler_pb2.ListJobsRequest(team=self.team, page=page), timeout=30),
                )

    @staticmethod
    async def _call(tally: Tally, op: str, call: Any) -> str | None:
        started = time.monotonic()
        try:
            reply = await call
        except (grpc.aio.AioRpcError, OSError) as exc:
            tally.record(op, 0.0, _error(exc))
            return None
        tally.record(op, time.monotonic() - started)
        job = getattr(reply, "job", None)
        return job.id if job is not None else ""

    async def audit(self) -> dict[str, Any]:
        listed: list[str] = []
        async with make_channel(self.target, token=services.TOKEN) as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            token = ""
            while True:
                reply = await stub.ListJobs(
                    scheduler_pb2.ListJobsRequest(
                        team=self.team, page=common_pb2.PageRequest(page_size=500, page_token=token)
                    ),
                    timeout=60,
                )
                listed.extend(job.id for job in reply.jobs)
                token = reply.page.next_page_token
                if not token:
                    break
        sent = set(self.submitted)
        return {
            "jobs_submitted": len(self.submitted),
            "jobs_listed": len(listed),
            "lost": len(sent - set(listed)),
            "duplicated": len(listed) - len(set(listed)) + len(self.submitted) - len(sent),
        }

    def processes(self) -> dict[str, ServiceProcess]:
        return {"scheduler": self._proc} if self._proc else {}

    def stop(self) -> None:
        if self._proc:
            self._proc.stop()


def beir_documents(folder: Path, limit: int) -> Iterator[retrieval_pb2.Document]:
    """The first ``limit`` documents of a BEIR ``corpus.jsonl`` (or ``.jsonl.gz``)."""
    path = folder / "corpus.jsonl"
    opener = gzip.open if not path.exists() else open
    with opener(path if path.exists() else folder / "corpus.jsonl.gz", "rt") as handle:
        for line in itertools.islice(handle, limit):
            row = json.loads(line)
            yield retrieval_pb2.Document(
                id=str(row["_id"]), text=row["text"] or row.get("title", ""), title=row.get("title", "")
            )


def beir_queries(folder: Path) -> list[str]:
    path = folder / "queries.jsonl"
    opener = gzip.open if not path.exists() else open
    with opener(path if path.exists() else folder / "queries.jsonl.gz", "rt") as handle:
        return [json.loads(line)["text"] for line in handle if line.strip()]


class Rag:
    """What the RAG API asks of the retrieval tier: hybrid top-``top_k`` from the retriever, then
    the reranker's top ``top_n`` of those passages. ``ingest`` documents of a BEIR folder first
    (documents/s is a figure); afterwards every ingested document must be searchable by its id's
    chunks (counted through the index's point count: ``lost``)."""

    name = "rag"

    def __init__(self, dataset: Path = DEFAULT_BEIR, documents: int = 1000, clients: int = 4) -> None:
        self.dataset, self.documents, self.clients = dataset, documents, clients
        self.top_k, self.top_n = 20, 5
        self.collection = "load"
        self.ingest_docs_per_s = 0.0
        self.ingested: set[str] = set()
        self.queries: list[str] = []
        self._retriever: ServiceProcess | None = None
        self._reranker: ServiceProcess | None = None

    def start(self, work: Path) -> None:
        if not (self.dataset / "corpus.jsonl").exists() and not (self.dataset / "corpus.jsonl.gz").exists():
            raise SystemExit(f"--dataset {self.dataset}: no corpus.jsonl (a BEIR folder is required)")
        self.queries = beir_queries(self.dataset)
        self._retriever = services.retriever(work)
        try:
            self._reranker = services.reranker(work)
            asyncio.run(self._ingest())
        except BaseException:
            self.stop()
            raise

    async def _ingest(self) -> None:
        docs = list(beir_documents(self.dataset, self.documents))
        assert self._retriever is not None
        started = time.monotonic()
        async with make_channel(self._retriever.grpc_target, token=services.TOKEN) as channel:
            stub = retrieval_pb2_grpc.RetrieverServiceStub(channel)
            for i in range(0, len(docs), 100):
                await stub.UpsertDocuments(
                    retrieval_pb2.UpsertDocumentsRequest(
                        collection=self.collection, documents=docs[i : i + 100]
                    ),
                    timeout=600,
                )
        self.ingested = {d.id for d in docs}
        self.ingest_docs_per_s = len(docs) / (time.monotonic() - started)

    async def drive(self, seconds: float, tally: Tally) -> None:
        assert self._retriever is not None and self._reranker is not None
        deadline = time.monotonic() + seconds
        async with (
            make_channel(self._retriever.grpc_target, token=services.TOKEN) as rc,
            make_channel(self._reranker.grpc_target, token=services.TOKEN) as kc,
        ):
            search = retrieval_pb2_grpc.RetrieverServiceStub(rc)
            rerank = rerank_pb2_grpc.RerankerServiceStub(kc)
            await asyncio.gather(
                *(self._client(search, rerank, c, deadline, tally) for c in range(self.clients))
            )

    async def _client(
        self,
        search: retrieval_pb2_grpc.RetrieverServiceStub,
        rerank: rerank_pb2_grpc.RerankerServiceStub,
        client: int,
        deadline: float,
        tally: Tally,
    ) -> None:
        for n in itertools.count(client * 7919):
            if time.monotonic() >= deadline:
                return
            query = self.queries[n % len(self.queries)]
            started = time.monotonic()
            try:
                hits = await search.Search(  # type: ignore[misc]
                    retrieval_pb2.SearchRequest(collection=self.collection, query=query, top_k=self.top_k),
                    timeout=30,
                )
                searched = time.monotonic()
                passages = [rerank_pb2.Passage(id=c.chunk_id, text=c.text) for c in hits.chunks]
                await rerank.Rerank(  # type: ignore[misc]
                    rerank_pb2.RerankRequest(query=query, passages=passages, top_n=self.top_n), timeout=30
                )
            except (grpc.aio.AioRpcError, OSError) as exc:
                tally.record("rag", 0.0, _error(exc))
                continue
            done = time.monotonic()
            tally.record("search", searched - started)
            tally.record("rerank", done - searched)
            tally.latencies.setdefault("rag", []).append(done - started)

    async def audit(self) -> dict[str, Any]:
        """Every ingested document is found by a search for its own text's opening words."""
        assert self._retriever is not None
        missing = 0
        sample = sorted(self.ingested)[:: max(1, len(self.ingested) // 50)]
        docs = {d.id: d for d in beir_documents(self.dataset, self.documents)}
        async with make_channel(self._retriever.grpc_target, token=services.TOKEN) as channel:
            stub = retrieval_pb2_grpc.RetrieverServiceStub(channel)
            for doc_id in sample:
                words = " ".join(docs[doc_id].text.split()[:30])
                reply = await stub.Search(
                    retrieval_pb2.SearchRequest(
                        collection=self.collection,
                        query=words[:2000],
                        top_k=10,
                        mode=retrieval_pb2.SEARCH_MODE_SPARSE,
                    ),
                    timeout=30,
                )
                missing += doc_id not in {c.document_id for c in reply.chunks}
        return {
            "documents_ingested": len(self.ingested),
            "ingest_docs_per_s": round(self.ingest_docs_per_s, 1),
            "documents_checked": len(sample),
            "lost": missing,
        }

    def processes(self) -> dict[str, ServiceProcess]:
        found = {"retriever": self._retriever, "reranker": self._reranker}
        return {k: v for k, v in found.items() if v is not None}

    def stop(self) -> None:
        for proc in (self._reranker, self._retriever):
            if proc:
                proc.stop()


class Inference:
    """Product apps streaming completions through the gateway to a model server (a random tiny
    Llama: the figures are the serving path's, not a model's). Each request must stream tokens and
    end with ``[DONE]``; anything else is an error."""

    name = "inference"

    def __init__(self, clients: int = 8, max_tokens: int = 16) -> None:
        self.clients, self.max_tokens = clients, max_tokens
        self._server: ServiceProcess | None = None
        self._gateway: ServiceProcess | None = None

    def start(self, work: Path) -> None:
        self._server, self._gateway = services.inference(work)

    async def drive(self, seconds: float, tally: Tally) -> None:
        assert self._gateway is not None
        deadline = time.monotonic() + seconds
        headers = {"Authorization": f"Bearer {services.TENANT_KEY}"}
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(self._gateway.http_url, headers=headers, timeout=timeout) as http:
            await asyncio.gather(*(self._client(http, c, deadline, tally) for c in range(self.clients)))

    async def _client(self, http: aiohttp.ClientSession, client: int, deadline: float, tally: Tally) -> None:
        for n in itertools.count():
            if time.monotonic() >= deadline:
                return
            body = {
                "model": "tiny",
                "prompt": f"To be or not to be, client {client} asks question {n}:",
                "max_tokens": self.max_tokens,
                "temperature": 0.8,
                "seed": n,
                "stream": True,
                "ignore_eos": True,
            }
            started = time.monotonic()
            first: float | None = None
            done = False
            try:
                async with http.post("/v1/completions", json=body) as reply:
                    if reply.status != 200:
                        tally.record("completion", 0.0, f"HTTP {reply.status}")
                        continue
                    async for raw in reply.content:
                        line = raw.decode().strip()
                        if not line.startswith("data:"):
                            continue
                        if line == "data: [DONE]":
                            done = True
                        elif first is None:
                            first = time.monotonic()
            except (aiohttp.ClientError, TimeoutError) as exc:
                tally.record("completion", 0.0, type(exc).__name__)
                continue
            if not done or first is None:
                tally.record("completion", 0.0, "stream ended without tokens and [DONE]")
                continue
            tally.record("completion", time.monotonic() - started)
            tally.latencies.setdefault("ttft", []).append(first - started)

    async def audit(self) -> dict[str, Any]:
        """The model server has no request left running or waiting once the clients stopped."""
        assert self._server is not None
        async with aiohttp.ClientSession() as http, http.get(f"{self._server.http_url}/metrics") as reply:
            text = await reply.text()
        left = 0.0
        for line in text.splitlines():
            if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")):
                left += float(line.rsplit(" ", 1)[1])
        return {"requests_left_on_server": left}

    def processes(self) -> dict[str, ServiceProcess]:
        found = {"model_server": self._server, "inference_gateway": self._gateway}
        return {k: v for k, v in found.items() if v is not None}

    def stop(self) -> None:
        for proc in (self._gateway, self._server):
            if proc:
                proc.stop()
