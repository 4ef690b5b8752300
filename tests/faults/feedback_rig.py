"""The preference service with its broker behind a fault proxy, and raters whose every answer is
recorded in a :class:`~faultkit.history.History`: the rig of the feedback scenarios.

Tansu advertises the proxy's port, so every connection a Kafka client makes (the service's
producer, the checking consumer) goes through the ``broker`` link. Raters answer through the
JSON API, paced so their answers span the scenario; an answer without a reply (connection
refused, reset, timed out) is ``info`` and sent again unchanged (the service records a repeated
answer once); a clear refusal (503, 507 with a message) is ``fail`` and sent again after a pause;
anything else (a bare 500) is ``info`` and kept in ``unclear`` for the test to reject.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from fault_platform import wait_ready
from faultkit.history import History
from forge.events.v1 import events_pb2
from test_service_faults import announced

from forge_kit.events import ensure_topics
from forge_kit.paths import data_dir
from forge_kit.testing import ServiceProcess, TansuBroker, base_env, free_port
from forge_kit.testing.fault_proxy import FaultProxy

TOKEN = "faults-feedback-token"
PASSWORD = "faults-rater-password"
RATERS = 3
CLEAR_REFUSALS = {503, 507}
BROKEN_OUTBOX = Path(__file__).resolve().parent / "broken_outbox"


@dataclass
class FeedbackRig:
    root: Path
    seeds: int
    broken_outbox: bool = False
    data: Path = field(init=False)
    broker: TansuBroker = field(init=False)
    link: FaultProxy = field(init=False)
    service: ServiceProcess = field(init=False)
    history: History = field(default_factory=History)
    unclear: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # clear refusals of any call, reads included
    dropped: list[str] = field(default_factory=list)  # calls of any kind that got no answer at all

    def __post_init__(self) -> None:
        self.data = self.root / "feedback"

    def start(self) -> FeedbackRig:
        """Raters, broker and proxy, the service; ``data`` may already be a mount of its own."""
        self.data.mkdir(parents=True, exist_ok=True)
        for r in range(RATERS):
            subprocess.run(
                [
                    str(Path(sys.executable).with_name("forge")),
                    "feedback",
                    "add-rater",
                    f"rater{r}",
                    "--data-dir",
                    str(self.data),
                ],
                env={**os.environ, "FORGE_FEEDBACK_PASSWORD": PASSWORD},
                check=True,
                capture_output=True,
                timeout=120,
            )
        proxy_port = free_port()
        self.broker = TansuBroker(log_path=str(self.root / "tansu.log"), advertised_port=proxy_port).start()
        self.link = FaultProxy(("127.0.0.1", self.broker.port), port=proxy_port, name="broker").start()
        asyncio.run(ensure_topics(self.link.address))
        env = base_env(
            "preference_feedback",
            token=TOKEN,
            data_dir=self.data,
            kafka=self.link.address,
            grpc_port=free_port(),
            http_port=free_port(),
            seed_dir=str(data_dir() / "preferences" / "hh-rlhf"),
            seed_limit=str(self.seeds),
            overlap_k=str(RATERS),
        )
        if self.broken_outbox:
            env["PYTHONPATH"] = os.pathsep.join(
                filter(None, [str(BROKEN_OUTBOX), os.environ.get("PYTHONPATH")])
            )
        self.service = ServiceProcess(
            "forge_preference_feedback", env=env, log_path=str(self.root / "feedback.log")
        )
        self.service.start(120)
        return self

    def stop(self) -> None:
        for part in ("service", "link", "broker"):
            if hasattr(self, part):
                getattr(self, part).stop()

    def restart_service(self) -> None:
        self.service.kill()
        self.service.start(120)
        wait_ready(self.service)

    # The raters.

    async def rate(self, pace_s: float) -> None:
        async with httpx.AsyncClient(base_url=self.service.http_url, timeout=10) as http:
            await asyncio.gather(*(self._rater(http, f"rater{r}", pace_s) for r in range(RATERS)))

    def _refusal(self, what: str, reply: httpx.Response) -> str:
        """File a 5xx as a clear refusal or an unclear error; returns what it said."""
        said = f"{what}: {reply.status_code} {reply.text[:200]}"
        assert reply.status_code >= 500, said  # a 4xx here is a bug of the test
        clear = reply.status_code in CLEAR_REFUSALS and "message" in reply.text
        (self.refused if clear else self.unclear).append(said)
        return said

    async def _call(
        self, http: httpx.AsyncClient, method: str, path: str, **kwargs: object
    ) -> httpx.Response:
        """Log in, take the next item (a lease: a write too): retried until it answers 200."""
        deadline = time.monotonic() + 120
        while True:
            try:
                reply = await http.request(method, path, **kwargs)  # type: ignore[arg-type]
                if reply.status_code == 200:
                    return reply
                self._refusal(f"{method} {path}", reply)
            except httpx.TransportError as exc:
                self.dropped.append(f"{method} {path}: {type(exc).__name__}")
            assert time.monotonic() < deadline, f"{path} never answered"
            await asyncio.sleep(0.2)

    async def _rater(self, http: httpx.AsyncClient, rater: str, pace_s: float) -> None:
        login = await self._call(
            http, "POST", "/api/v1/sessions", json={"rater_id": rater, "password": PASSWORD}
        )
        headers = {"Authorization": f"Bearer {login.json()['token']}"}
        for n in range(10_000):
            item = (await self._call(http, "GET", "/api/v1/comparisons/next", headers=headers)).json()[
                "comparison"
            ]
            if item is None:
                return
            choice = ("A", "B", "TIE")[n % 3]
            key = f"{rater}/{item['id']}"
            while True:
                op = self.history.invoke(rater, "write", key, choice)
                try:
                    reply = await http.post(
                        "/api/v1/preferences",
                        headers=headers,
                        json={"comparison_id": item["id"], "choice": choice},
                    )
                except httpx.TransportError as exc:
                    self.history.info(op, f"{type(exc).__name__}: {exc}")
                    self.dropped.append(f"POST /api/v1/preferences: {type(exc).__name__}")
                    await asyncio.sleep(0.2)
                    continue
                if reply.status_code == 200:
                    self.history.ok(op, reply.json()["preference_id"])
                    break
                said = self._refusal("POST /api/v1/preferences", reply)
                if said in self.refused:
                    self.history.fail(op, said.split(": ", 1)[1])
                else:
                    self.history.info(op, said)
                await asyncio.sleep(0.3)
            await asyncio.sleep(pace_s)
        raise AssertionError("the queue never ran dry")

    # What the system holds after the heal.

    def rows(self) -> dict[str, str]:
        """preference id → the client's key (rater/comparison) of every row in the database."""
        with sqlite3.connect(self.data / "preference_feedback.db") as conn:
            rows = conn.execute("SELECT id, rater_id, comparison_id FROM feedback_preferences").fetchall()
        return {str(i): f"{r}/{c}" for i, r, c in rows}

    def truncate_wal(self) -> None:
        """Checkpoint the service's database and truncate its write-ahead log (any connection
        may): SQLite reuses a WAL file's space, so without this a disk filled afterwards would
        not be felt until the log outgrew its old size."""
        with sqlite3.connect(self.data / "preference_feedback.db", timeout=30) as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()

    def outbox_pending(self) -> int:
        with sqlite3.connect(self.data / "preference_feedback.db") as conn:
            return int(
                conn.execute("SELECT count(*) FROM forge_outbox WHERE published_at IS NULL").fetchone()[0]
            )

    async def on_kafka(self, rows: dict[str, str], timeout_s: float) -> tuple[Counter[str], int]:
        """client key → how often its preference is on the broker; and events of unknown ids."""
        seen = await announced(
            self.link.address,
            events_pb2.PreferenceRecorded,
            lambda e: e.preference_id,  # type: ignore[attr-defined]
            len(rows),
            timeout_s=timeout_s,
        )
        counts: Counter[str] = Counter()
        unknown = 0
        for preference_id, times in seen.items():
            if preference_id in rows:
                counts[rows[preference_id]] += times
            else:
                unknown += 1
        return counts, unknown
