"""The :class:`~forge_eval.runner.SuiteRunner` that runs the YAML tasks for the eval service.

RunSuite's suite names a shipped task (``forge_eval/tasks/<suite>.yaml``); the run goes through
the same harness as ``forge eval run`` — templates, few-shot selection, log-likelihood multiple
choice, the HumanEval sandbox, the response cache keyed by model identity — so a service run and a
CLI run of one task score alike. The task file's hash is part of the scorer version, and so of
the run-spec hash: editing a template makes runs incomparable with older ones, as it should.
RunSuite's sampling options override the task file's only where they differ from their defaults
(an option left at its default keeps the task's value, e.g. MMLU's 5 shots). A ``smoke`` tier run
scores each task's stratified subset (``smoke`` in the task file).

:class:`TaskCatalog` is the matching :class:`~forge_eval.spec.SuiteCatalog`: the suites are the
shipped tasks whose data is present (benchmarks and corpora alike), and a suite's dataset hashes
are those of its task's dataset and few-shot dataset, checked against the pins in the task file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import httpx

from forge_eval.backend import BackendError, OpenAIBackend, ResponseCache, declared_identity
from forge_eval.harness import run_task
from forge_eval.runner import ExampleResult, RunnerError, pinned_model
from forge_eval.scorers import get_scorer
from forge_eval.spec import OPTIONS, RunSpec
from forge_eval.tasks import DataRoots, TaskConfig, dataset_hash, load_task, shipped_tasks
from forge_kit import errors
from forge_kit.modelref import label


class TaskCatalog:
    """The shipped tasks whose data is present, as RunSuite's suites."""

    def __init__(self, roots: DataRoots) -> None:
        self._roots = roots

    @property
    def root(self) -> Path:
        return self._roots.benchmarks

    def suites(self) -> list[str]:
        found = []
        for name in sorted(shipped_tasks()):
            task = load_task(name)
            folder = self._roots.of(task.dataset.root)
            if any(p.is_file() for p in folder.glob(task.dataset.path)):
                found.append(name)
        return found

    def dataset_hashes(self, suite: str) -> dict[str, str]:
        task = load_task(suite)
        hashes = {f"{task.dataset.root}/{task.dataset.path}": dataset_hash(self._roots, task.dataset)}
        shots = task.fewshot.dataset
        if shots is not None:
            hashes[f"{shots.root}/{shots.path}"] = dataset_hash(self._roots, shots, "task.fewshot.dataset")
        return hashes


class TaskSuiteRunner:
    """Runs shipped YAML tasks against an OpenAI-compatible endpoint for :class:`~forge_eval.runs.RunService`."""

    def __init__(
        self,
        roots: DataRoots,
        *,
        cache_path: Path | None = None,
        token: str = "",
        timeout_s: float = 60.0,
        batch_size: int = 16,
        concurrency: int = 8,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._roots = roots
        self._cache = ResponseCache(cache_path) if cache_path else None
        self._token = token
        self._timeout_s = timeout_s
        self._batch_size = batch_size
        self._concurrency = concurrency
        self._transport = transport

    def supports(self, suite: str) -> bool:
        return suite in shipped_tasks()

    def scorer_version(self, suite: str) -> str:
        task = load_task(suite)
        digest = hashlib.sha256(json.dumps(task.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()
        return f"{get_scorer(task.scorer.name, task.output_type).version}+task-{digest[:12]}"

    def _configure(self, spec: RunSpec) -> TaskConfig:
        task = load_task(spec.suite)
        changed = {k: v for k, v in spec.sampling.items() if k in OPTIONS and v != OPTIONS[k].default}
        generation: dict[str, Any] = {
            k: changed[k] for k in ("temperature", "top_p", "max_tokens") if k in changed
        }
        update: dict[str, Any] = {}
        if generation:
            update["generation"] = task.generation.model_copy(update=generation)
        if "num_fewshot" in changed:
            update["fewshot"] = task.fewshot.model_copy(update={"num": int(changed["num_fewshot"])})
        return task.model_copy(update=update) if update else task

    async def run(self, spec: RunSpec, endpoint: str, *, token: str | None = None) -> list[ExampleResult]:
        """1. Apply the spec's option overrides to the task; 2. resolve the served model's
        identity; 3. run the task (its smoke subset for the smoke tier) through the cache; 4. one
        result per example and metric."""
        task = self._configure(spec)
        backend = OpenAIBackend(
            endpoint,
            label(spec.model_name, spec.model_version),
            cache=self._cache,
            token=self._token if token is None else token,
            timeout_s=self._timeout_s,
            batch_size=self._batch_size,
            concurrency=self._concurrency,
            transport=self._transport,
        )
        try:
            try:
                identity = await backend.identity()
            except BackendError:
                backend.model = spec.model_name
                identity = await backend.identity()
                backend.model = pinned_model(spec, backend.served_version)
                if backend.model != spec.model_name and backend.served_version != spec.model_version:
                    # The card shows another version of the name: the answers are the pinned
                    # version's, so is the identity that keys them in the cache.
                    identity = declared_identity(backend.model, spec.model_version)
            result = await run_task(
                task,
                self._roots,
                backend,
                identity,
                limit=spec.limit,
                seed=spec.seed,
                smoke=spec.tier == "smoke",
            )
        except (BackendError, errors.ForgeError) as exc:
            raise RunnerError(str(exc)) from exc
        finally:
            await backend.aclose()
        return [
            ExampleResult(
                example_id=sample["id"],
                metric=metric,
                score=float(score),
                prompt=sample["prompt"],
                output=json.dumps(sample["response"], sort_keys=True),
                extracted=sample["extracted"].get(metric, ""),
                target=sample["target"],
            )
            for sample in result.samples
            for metric, score in sorted(sample["scores"].items())
        ]
