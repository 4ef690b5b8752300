"""Activities of the ``synthetic`` workflow: the teacher, the student's samples, small summaries
and tracking. Everything large goes through files in the run's folder (``work_dir``, under the
input's ``work_uri``, which the jobs and this process share); Temporal carries paths and counts.

Every activity is idempotent: one that finished wrote its summary (``<stage>.json``) last,
atomically, and a retry that finds it returns it instead of calling the teacher or the student
again; one that died half-way left only temporary files (:meth:`ObjectStore.open_atomic`).

Credentials: the teacher's and the student's tokens are settings of this process
(``FORGE_SYNTHETIC_…``), never workflow input, and each is sent only to the URL it was configured
with; an input that names another endpoint is called without one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import tempfile
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from temporalio import activity
from temporalio.exceptions import ApplicationError

from forge_experiments import teacher_protocol as tp
from forge_kit.objectstore import ObjectStore
from forge_orchestrator.synthetic.teacher import TeacherClient

#: Largest summary read back into the workflow (they hold counts and a histogram).
MAX_SUMMARY_BYTES = 1 << 20
#: Largest line of a problems or prompts file this process reads.
MAX_LINE_CHARS = 64 * 1024
PROBLEMS_PER_CALL = 8


@dataclass
class GenerateInput:
    work_dir: str
    teacher_url: str
    teacher_model: str
    templates: list[str]
    problems: int
    k: int
    seed: int
    timeout_s: float = 60.0
    max_attempts: int = 4
    concurrency: int = 4


@dataclass
class GenerateResult:
    path: str
    """``problems.jsonl``: one problem a line with its solutions (the training library's format)."""
    problems: int
    """Problems written (each with at least one solution)."""
    asked: int
    without_solutions: int
    teacher: dict[str, Any] = field(default_factory=dict)
    """:class:`~forge_orchestrator.synthetic.teacher.TeacherStats` as a dict."""


@dataclass
class SampleInput:
    work_dir: str
    prompts: str
    """File name (in ``work_dir``) of the prompts: JSON lines ``{"id", "prompt"}``."""
    student_url: str
    student_model: str
    n: int
    max_tokens: int = 64
    temperature: float = 1.0
    seed: int = 0
    concurrency: int = 4
    timeout_s: float = 120.0


@dataclass
class SampleResult:
    path: str
    """``samples.jsonl``: ``{"id", "completions": [...]}`` a line."""
    prompts: int
    sampled: int
    """Prompts with all ``n`` samples."""
    failed: dict[str, int] = field(default_factory=dict)
    """Prompts without samples, by reason."""


@dataclass
class WriteInput:
    path: str
    data: dict[str, Any]


@dataclass
class TrackInput:
    workflow_id: str
    name: str = ""
    params: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    artifacts: list[str] = field(default_factory=list)
    """Files to upload (paths on this host)."""
    status: str = ""
    """``FINISHED``, ``FAILED`` or ``KILLED`` closes the run; empty leaves it open."""
    histogram: dict[str, int] = field(default_factory=dict)
    """Problems per pass-rate bin: drawn as the artifact ``pass_rates.png`` (with the band)."""
    band: list[float] = field(default_factory=list)


class Tracker(Protocol):
    """What the workflow needs of experiment tracking (``forge_orchestrator.tracking.tracker.Tracker``)."""

    def ensure_workflow_run(self, workflow_id: str, role: str, name: str, params: dict[str, Any]) -> str: ...

    def set_tags(self, run_id: str, tags: dict[str, Any]) -> None: ...

    def log_params(self, run_id: str, params: dict[str, Any]) -> list[str]: ...

    def log_metrics(self, run_id: str, step: int, metrics: dict[str, float]) -> int: ...

    def log_artifact(self, run_id: str, path: str, artifact_path: str | None = None) -> None: ...

    def set_terminated(self, run_id: str, status: str) -> None: ...

    def run_url(self, run_id: str) -> str: ...


@dataclass(frozen=True)
class Endpoint:
    """A configured OpenAI-compatible endpoint and the token it was issued."""

    url: str
    token: str = ""

    def token_for(self, url: str) -> str:
        return self.token if url.rstrip("/") == self.url.rstrip("/") else ""


HEARTBEAT_S = 30.0


@contextlib.asynccontextmanager
async def heartbeating(every_s: float = HEARTBEAT_S) -> AsyncIterator[None]:
    """Heartbeat every ``every_s`` while the body runs: a slow teacher or student (long timeouts,
    Retry-After waits) never looks like a dead worker, and a dead worker is seen within the
    workflow's heartbeat timeout."""

    async def beat() -> None:
        while True:
            activity.heartbeat()
            await asyncio.sleep(every_s)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _seed(*parts: object) -> int:
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def _read_jsonl(text: str, what: str) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if len(line) > MAX_LINE_CHARS:
            raise ApplicationError(f"{what} line {number} is too long", type="BadFile", non_retryable=True)
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ApplicationError(
                f"{what} line {number}: {exc.msg}", type="BadFile", non_retryable=True
            ) from None
        if not isinstance(row, dict):
            raise ApplicationError(
                f"{what} line {number} is not an object", type="BadFile", non_retryable=True
            )
        rows.append(row)
    return rows


class SyntheticActivities:
    """The workflow's activities (one instance per worker)."""

    def __init__(self, teacher: Endpoint, student: Endpoint, tracker: Tracker | None = None) -> None:
        self._teacher = teacher
        self._student = student
        self._tracker = tracker

    @staticmethod
    def _summary(store: ObjectStore, name: str) -> dict[str, Any] | None:
        if not store.exists(name):
            return None
        data = json.loads(store.get_bytes(name))
        return data if isinstance(data, dict) else None

    # --- generate ------------------------------------------------------------------------------

    @activity.defn(name="synthetic_generate")
    async def generate(self, params: GenerateInput) -> GenerateResult:
        """``problems`` problems from the templates in turn (``PROBLEMS_PER_CALL`` a call), ``k``
        solutions each, into ``problems.jsonl``; the teacher's failures are counted, not raised."""
        store = ObjectStore(params.work_dir)
        done = await asyncio.to_thread(self._summary, store, "generate.json")
        if done is not None:
            return GenerateResult(**done)
        url = params.teacher_url or self._teacher.url
        if not url:
            raise ApplicationError("no teacher endpoint is configured", type="NoTeacher", non_retryable=True)
        # Which calls: per template, batches of up to PROBLEMS_PER_CALL, seeded by (seed, template, batch).
        share = [params.problems // len(params.templates)] * len(params.templates)
        for i in range(params.problems % len(params.templates)):
            share[i] += 1
        calls = [
            (template, batch, min(PROBLEMS_PER_CALL, count - batch * PROBLEMS_PER_CALL))
            for template, count in zip(params.templates, share, strict=True)
            for batch in range((count + PROBLEMS_PER_CALL - 1) // PROBLEMS_PER_CALL)
        ]
        limit = asyncio.Semaphore(params.concurrency)
        async with TeacherClient(
            url,
            params.teacher_model,
            self._teacher.token_for(url),
            timeout_s=params.timeout_s,
            max_attempts=params.max_attempts,
        ) as client:

            async def one(template: str, batch: int, count: int) -> list[dict[str, Any]]:
                async with limit:
                    found = await client.problems(
                        template, count, _seed(params.seed, template, batch) % 100_000_000
                    )
                rows = []
                for problem in found:
                    async with limit:
                        solutions = await client.solutions(problem, params.k, _seed(params.seed, problem.id))
                    rows.append(_record(template, batch, problem, solutions))
                return rows

            async with heartbeating():
                batches = await asyncio.gather(*(one(*call) for call in calls))
        rows = [row for batch in batches for row in batch]
        kept = [row for row in rows if row["solutions"]]
        body = "".join(json.dumps(row, sort_keys=True) + "\n" for row in kept).encode()
        await asyncio.to_thread(store.put_bytes, "problems.jsonl", body)
        result = GenerateResult(
            path=store.path("problems.jsonl"),
            problems=len(kept),
            asked=params.problems,
            without_solutions=len(rows) - len(kept),
            teacher=client.stats.as_dict(),
        )
        await asyncio.to_thread(store.put_bytes, "generate.json", json.dumps(asdict(result)).encode())
        return result

    # --- the student ---------------------------------------------------------------------------

    @activity.defn(name="synthetic_sample_student")
    async def sample_student(self, params: SampleInput) -> SampleResult:
        """``n`` completions of each prompt from the student through its OpenAI-compatible endpoint
        (the gateway, or a model server), one call a prompt, ``concurrency`` at a time; each
        prompt's seed comes from the input's seed and the prompt's id, so a retry asks the same."""
        import openai  # here, not at the top: the orchestrator's start-up does not pay for the SDK

        store = ObjectStore(params.work_dir)
        done = await asyncio.to_thread(self._summary, store, "sample.json")
        if done is not None:
            return SampleResult(**done)
        url = params.student_url or self._student.url
        if not url:
            raise ApplicationError("no student endpoint is configured", type="NoStudent", non_retryable=True)
        prompts = _read_jsonl(
            (await asyncio.to_thread(store.get_bytes, params.prompts)).decode(), params.prompts
        )
        failed: dict[str, int] = {}
        limit = asyncio.Semaphore(params.concurrency)
        client = openai.AsyncOpenAI(
            base_url=url,
            api_key=self._student.token_for(url) or "none",
            timeout=params.timeout_s,
            max_retries=4,
        )

        async def one(row: dict[str, Any]) -> dict[str, Any] | None:
            async with limit:
                try:
                    reply = await client.completions.create(
                        model=params.student_model,
                        prompt=str(row["prompt"]),
                        n=params.n,
                        max_tokens=params.max_tokens,
                        temperature=params.temperature,
                        seed=_seed(params.seed, row["id"]),
                    )
                except openai.BadRequestError:  # e.g. longer than the student's context
                    failed["refused"] = failed.get("refused", 0) + 1
                    return None
                except openai.APIError as exc:
                    reason = type(exc).__name__
                    if isinstance(
                        exc, openai.AuthenticationError | openai.PermissionDeniedError | openai.NotFoundError
                    ):
                        raise ApplicationError(
                            f"the student endpoint refused: {exc}", type="StudentRefused", non_retryable=True
                        ) from None
                    failed[reason] = failed.get(reason, 0) + 1
                    return None
            texts = [c.text or "" for c in sorted(reply.choices, key=lambda c: c.index)]
            if len(texts) != params.n:
                failed["wrong_choice_count"] = failed.get("wrong_choice_count", 0) + 1
                return None
            return {"id": row["id"], "completions": texts}

        try:
            async with heartbeating():
                results = await asyncio.gather(*(one(row) for row in prompts))
        finally:
            await client.close()
        rows = [r for r in results if r is not None]
        if prompts and not rows and set(failed) - {"refused"}:
            # Nothing came back and not because of the prompts: the student is away. Retry later.
            raise ApplicationError(
                f"no samples from the student at {url}: {failed}", type="StudentUnavailable"
            )
        body = "".join(json.dumps(r) + "\n" for r in rows).encode()
        await asyncio.to_thread(store.put_bytes, "samples.jsonl", body)
        result = SampleResult(store.path("samples.jsonl"), len(prompts), len(rows), failed)
        await asyncio.to_thread(store.put_bytes, "sample.json", json.dumps(asdict(result)).encode())
        return result

    # --- summaries and tracking ----------------------------------------------------------------

    @activity.defn(name="synthetic_read_summary")
    async def read_summary(self, path: str) -> dict[str, Any]:
        """A JSON object a job wrote (a stage's summary), at most :data:`MAX_SUMMARY_BYTES`."""
        base, _, name = path.rpartition("/")
        store = ObjectStore(base or ".")
        try:
            data = await asyncio.to_thread(store.get_bytes, name)
        except FileNotFoundError:
            raise ApplicationError(
                f"{path} does not exist", type="MissingSummary", non_retryable=True
            ) from None
        if len(data) > MAX_SUMMARY_BYTES:
            raise ApplicationError(
                f"{path} is over {MAX_SUMMARY_BYTES} bytes", type="BadSummary", non_retryable=True
            )
        try:
            loaded = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApplicationError(
                f"{path} is not JSON: {exc}", type="BadSummary", non_retryable=True
            ) from None
        if not isinstance(loaded, dict):
            raise ApplicationError(f"{path} is not a JSON object", type="BadSummary", non_retryable=True)
        return loaded

    @activity.defn(name="synthetic_write_summary")
    async def write_summary(self, params: WriteInput) -> str:
        """Write ``data`` as JSON at ``path``, atomically; returns the path."""
        base, _, name = params.path.rpartition("/")
        store = ObjectStore(base or ".")
        body = json.dumps(params.data, indent=2, sort_keys=True).encode()
        await asyncio.to_thread(store.put_bytes, name, body)
        return store.path(name)

    @activity.defn(name="synthetic_track")
    async def track(self, params: TrackInput) -> dict[str, str]:
        """The workflow's MLflow run (made once, found again by the workflow id): params, tags,
        metrics at step 0, artifacts, and its end; ``{}`` without tracking."""
        tracker = self._tracker
        if tracker is None:
            return {}

        def go() -> dict[str, str]:
            run_id = tracker.ensure_workflow_run(
                params.workflow_id, "synthetic", params.name, dict(params.params)
            )
            if params.tags:
                tracker.set_tags(run_id, dict(params.tags))
            if params.metrics:
                tracker.log_metrics(run_id, 0, dict(params.metrics))
            for path in params.artifacts:
                tracker.log_artifact(run_id, path)
            if params.histogram:
                with tempfile.TemporaryDirectory() as folder:
                    chart = Path(folder) / "pass_rates.png"
                    draw_histogram(params.histogram, params.band, chart, params.workflow_id)
                    tracker.log_artifact(run_id, str(chart))
            if params.status:
                tracker.set_terminated(run_id, params.status)
            return {"run_id": run_id, "url": tracker.run_url(run_id)}

        return await asyncio.to_thread(go)

    def methods(self) -> list[Any]:
        return [self.generate, self.sample_student, self.read_summary, self.write_summary, self.track]


def draw_histogram(histogram: dict[str, int], band: list[float], path: Path, title: str) -> None:
    """A bar per pass-rate bin, the band's bounds as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4), dpi=100)
    axes = figure.subplots()
    lows = [float(label.split("-")[0]) for label in histogram]
    width = (lows[1] - lows[0]) if len(lows) > 1 else 1.0
    axes.bar(lows, list(histogram.values()), width=width * 0.9, align="edge")
    for bound in band:
        axes.axvline(bound, color="grey", linestyle="--")
    axes.set_xlabel("student pass rate")
    axes.set_ylabel("problems")
    axes.set_title(f"pass rates: {title}"[:80])
    figure.tight_layout()
    figure.savefig(path)


def _record(
    template: str, batch: int, problem: tp.TeacherProblem, solutions: list[tp.TeacherSolution]
) -> dict[str, Any]:
    """A problem as the training library reads it (``forge_training.synthetic.problems.Problem``)."""
    return {
        "id": f"{template}/{batch}/{problem.id}"[:200],
        "template": template,
        "topic": problem.topic,
        "split": "train",
        "level": 0,
        "question": problem.question,
        "solutions": [{"text": s.text, "program": s.program or "", "planted": ""} for s in solutions],
        "reference": problem.reference,
    }
