"""The ``synthetic`` workflow: reasoning data from a teacher, verified, deduplicated and
decontaminated, filtered to the student's difficulty band, versioned, and used to fine-tune the
student (STaR / ReST-EM: generate, verify, filter, fine-tune).

In numbered steps (every file under ``<work_uri>/<workflow id>/``, the run's folder):

1. **track**: the run's MLflow run (tags ``forge.workflow_id``, ``forge.role=synthetic``; the
   input as params), when tracking is configured;
2. **generate** (activity): the teacher — any OpenAI-compatible endpoint
   (:mod:`.teacher`; vLLM with a strong model in production, the programmatic teacher here) —
   writes ``problems`` problems from the seed templates and ``k`` solutions each into
   ``problems.jsonl``. Malformed answers, timeouts and 429s are retried and counted; a call that
   gives up costs its problems, never the run. No problem at all ends the run (``no_problems``);
3. **curate** (a job through the scheduler, ``forge_training.synthetic.job curate``): every
   solution verified (SymPy on the final answer and the calculator steps, programs-of-thought
   in the eval sandbox), disagreements dropped or settled by majority (``policy``), a problem
   whose verifier throws dropped with the reason; near-duplicates removed (MinHash) within the
   set and against every eval benchmark's test split; the student's prompts written. Nothing
   left ends the run (``nothing_verified``);
4. **student**: the student samples ``samples`` answers per problem through the platform (its
   OpenAI-compatible endpoint: the inference gateway, or a model server). Where promotions roll
   replicas (the orchestrator's ``promote_deploy``) and the student is sampled through the
   gateway, the student is a deployment's replica for the sampling, through the single driver
   promotions use (:mod:`forge_orchestrator.deploy.rollout`): ``student_uri`` is deployed as
   ``<student_model>:<run version>`` (a version of this run's own, so the gateway routes the
   samples to this deployment's replicas only, whatever else serves ``student_model``) with the
   ``promote_deploy_*`` settings, the samples name it, and it is drained right after (also when
   sampling fails or the run is cancelled). A deployment not ready within
   ``promote_deploy_ready_timeout_s`` fails the run. Elsewhere (``promote_deploy`` off, or a
   ``student_url`` of the input or of ``FORGE_SYNTHETIC_STUDENT_URL``) ``student_model`` is
   sampled at the endpoint as it is;
5. **band** (a job): pass rates, their histogram, the problems in ``[band_low, band_high]``; an
   empty band ends the run (``empty_band``) with the histogram in the message, the result and
   MLflow. Otherwise the band is written as the versioned dataset: token shards and the SFT
   file, content hash, and ``lineage.json`` (teacher, templates, filters, counts at every stage);
6. **SFT**: the student fine-tuned on the dataset through the ``training`` workflow (a child:
   a scheduler job from the student's checkpoint, ``recipe`` with the dataset's path);
7. **held-out eval** (a job): the student before and after SFT on problems of the held-out
   templates, with intervals and the paired difference;
8. **record**: ``summary.json``, the lineage and the counts on the MLflow run, which is closed.

Activities are idempotent (a finished stage's summary is found again) and jobs are submitted by
request id, so a worker restart repeats nothing. Cancelling the workflow cancels the job it
waits on (the children do); a failure closes the MLflow run FAILED with the reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError, is_cancelled_exception

with workflow.unsafe.imports_passed_through():
    from forge_experiments.jobcmd import SyntheticStageCommand
    from forge_kit.modelref import ModelRef
    from forge_orchestrator.deploy.rollout import drain_version, serve_version
    from forge_orchestrator.inbox import ACTIVITY_RETRY, ACTIVITY_TIMEOUT, PROGRESS_QUERY
    from forge_orchestrator.rlhf.job import JobInput, JobResult, JobWorkflow
    from forge_orchestrator.routing import AUTO_EVAL_LABEL
    from forge_orchestrator.synthetic.activities import (
        GenerateInput,
        GenerateResult,
        SampleInput,
        SampleResult,
        SyntheticActivities,
        TrackInput,
        WriteInput,
    )
    from forge_orchestrator.synthetic.model import SyntheticInput, SyntheticResult
    from forge_orchestrator.training.model import TrainInput, TrainResult
    from forge_orchestrator.training.workflow import TrainWorkflow

__all__ = ["SYNTHETIC_WORKFLOWS", "SyntheticInput", "SyntheticResult", "SyntheticWorkflow"]

#: The teacher and the student may take long; their activities heartbeat every 30 s while they run.
LONG_ACTIVITY = timedelta(hours=6)
HEARTBEAT = timedelta(minutes=5)
#: Tracking outwaits an MLflow server that is away (as the sweep's does), within a bound.
TRACK_TIMEOUT = timedelta(minutes=3)
TRACK_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30), maximum_attempts=20
)
#: Histories recorded before the student was deployed for its sampling replay without it.
STUDENT_DEPLOYMENT_PATCH = "synthetic-student-deployment"
#: How often the wait for the student's replicas (and for its drain) polls.
DEPLOY_POLL_S = 2.0


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts])


def histogram_line(histogram: dict[str, int]) -> str:
    return ", ".join(f"{b}: {n}" for b, n in histogram.items())


def student_ref(student_model: str, workflow_id: str) -> ModelRef:
    """The student as this run deploys it: ``student_model``'s name pinned to a version of the run's own."""
    version = "synthetic-" + hashlib.sha256(workflow_id.encode()).hexdigest()[:12]
    return ModelRef(ModelRef.parse(student_model).name, version)


@workflow.defn(name="synthetic")
class SyntheticWorkflow:
    def __init__(self) -> None:
        self._step = "starting"
        self._result: SyntheticResult | None = None

    @workflow.query(name=PROGRESS_QUERY)
    def progress(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self._step}
        if self._result is not None:
            out.update({k: v for k, v in dataclasses.asdict(self._result).items() if k != "outcome"})
        return out

    async def _act(self, method: Any, arg: Any, *, long: bool = False) -> Any:
        if method == SyntheticActivities.track:
            timeout, retry, beat = TRACK_TIMEOUT, TRACK_RETRY, None
        elif long:
            timeout, retry, beat = LONG_ACTIVITY, ACTIVITY_RETRY, HEARTBEAT
        else:
            timeout, retry, beat = ACTIVITY_TIMEOUT, ACTIVITY_RETRY, None
        return await workflow.execute_activity_method(
            method, arg, start_to_close_timeout=timeout, heartbeat_timeout=beat, retry_policy=retry
        )

    async def _stage(
        self, params: SyntheticInput, stage: str, options: list[tuple[str, str]]
    ) -> dict[str, Any]:
        """Run one ``synthetic.job`` stage as a job (the ``rlhf_job`` child) and read its summary."""
        assert self._result is not None
        work = self._result.work_dir
        command = SyntheticStageCommand(stage, work, tuple(options), params.python).argv()
        self._step = f"{stage} (job)"
        done: JobResult = await workflow.execute_child_workflow(
            JobWorkflow.run,
            JobInput(
                team=params.team,
                name=f"synthetic-{stage}",
                command=command,
                gpu_count=params.gpus if stage == "heldout" else 0,
                gpu_type=params.gpu_type if stage == "heldout" else "",
                timeout_s=params.job_timeout_s,
            ),
            id=f"{workflow.info().workflow_id}-{stage}",
            retry_policy=RetryPolicy(maximum_attempts=1),
        )
        summary: dict[str, Any] = await self._act(
            SyntheticActivities.read_summary, join(work, f"{stage}.json")
        )
        summary["job_id"] = done.job_id
        return summary

    @workflow.run
    async def run(self, params: SyntheticInput) -> SyntheticResult:
        wid = workflow.info().workflow_id
        result = self._result = SyntheticResult(outcome="", message="", work_dir=join(params.work_uri, wid))
        try:
            return await self._pipeline(params, result)
        except (asyncio.CancelledError, Exception) as exc:
            cancelled = is_cancelled_exception(exc)
            self._step = "cancelled" if cancelled else f"failed at {self._step}"
            if result.run_id:
                reason = "cancelled" if cancelled else f"{self._step}: {exc}"
                await self._act(
                    SyntheticActivities.track,
                    TrackInput(wid, tags={"forge.outcome": "cancelled" if cancelled else "failed",
                                          "forge.reason": reason[:2000]},
                               status="KILLED" if cancelled else "FAILED"),
                )  # fmt: skip
            raise

    async def _pipeline(self, params: SyntheticInput, result: SyntheticResult) -> SyntheticResult:
        wid = workflow.info().workflow_id
        work = result.work_dir
        # 1. Track.
        self._step = "tracking"
        params_view = {
            k: v
            for k, v in dataclasses.asdict(params).items()
            if k not in ("caller", "teacher_url", "student_url")
        }
        run = await self._act(
            SyntheticActivities.track,
            TrackInput(wid, name=f"synthetic-{wid}", params={k: str(v) for k, v in params_view.items()}),
        )
        result.run_id, result.run_url = run.get("run_id", ""), run.get("url", "")
        # The run's parameters beside its files: the dataset's lineage starts from them.
        await self._act(SyntheticActivities.write_summary, WriteInput(join(work, "run.json"), params_view))
        # 2. Generate.
        self._step = "generate (teacher)"
        generated: GenerateResult = await self._act(
            SyntheticActivities.generate,
            GenerateInput(
                work_dir=work,
                teacher_url=params.teacher_url,
                teacher_model=params.teacher_model,
                templates=list(params.templates),
                problems=params.problems,
                k=params.k,
                seed=params.seed,
                timeout_s=params.teacher_timeout_s,
                max_attempts=params.teacher_attempts,
                concurrency=params.concurrency,
            ),
            long=True,
        )
        result.teacher = generated.teacher
        result.stages["generate"] = {
            "asked": generated.asked,
            "problems": generated.problems,
            "without_solutions": generated.without_solutions,
        }
        if generated.problems == 0:
            reasons = "; ".join(generated.teacher.get("reasons", [])[-3:])
            return await self._end(params, "no_problems", f"the teacher gave no usable problem ({reasons})")
        # 3. Verify, deduplicate, decontaminate.
        curated = await self._stage(
            params,
            "curate",
            [
                ("policy", params.policy),
                ("dedup-threshold", repr(params.dedup_threshold)),
                ("contamination-threshold", repr(params.contamination_threshold)),
                ("decontaminate", "true" if params.decontaminate else "false"),
                ("student", params.student_uri),
            ],
        )
        result.stages["verify"] = curated.get("verify", {})
        result.stages["dedup"] = curated.get("dedup", {})
        kept = int(curated.get("kept", 0))
        if kept == 0:
            return await self._end(
                params,
                "nothing_verified",
                f"no problem survived verification and dedup: {curated.get('verify')}",
            )
        # 4. The student's samples, through the platform (on a deployment of its own where
        # promotions roll replicas).
        student: dict[str, Any] = {}
        try:
            if not params.student_url and workflow.patched(STUDENT_DEPLOYMENT_PATCH):
                await self._deploy_student(params, student)
            self._step = "student sampling"
            sampled: SampleResult = await self._act(
                SyntheticActivities.sample_student,
                SampleInput(
                    work_dir=work,
                    prompts="prompts.jsonl",
                    student_url=params.student_url,
                    student_model=student.get("model", params.student_model),
                    n=params.samples,
                    max_tokens=params.student_max_tokens,
                    temperature=params.student_temperature,
                    seed=params.seed,
                    concurrency=params.concurrency,
                ),
                long=True,
            )
        finally:
            # Also after a failure or a cancellation, the deployment ready or not.
            if student.get("model"):
                self._step = "student drain"
                student["drained"] = await drain_version(self._act, student["model"], DEPLOY_POLL_S)
        result.stages["student"] = {
            "prompts": sampled.prompts,
            "sampled": sampled.sampled,
            "failed": sampled.failed,
            **student,
        }
        # 5. The band, and the dataset.
        band = await self._stage(
            params,
            "band",
            [
                ("low", repr(params.band_low)),
                ("high", repr(params.band_high)),
                ("student", params.student_uri),
            ],
        )
        result.histogram = {str(k): int(v) for k, v in band.get("histogram", {}).items()}
        result.stages["band"] = band.get("counts", {})
        if not band.get("dataset"):
            return await self._end(
                params,
                "empty_band",
                f"no problem has a pass rate in [{params.band_low:g}, {params.band_high:g}] over "
                f"{params.samples} samples; pass-rate histogram: {histogram_line(result.histogram)}",
            )
        result.dataset = dict(band["dataset"])
        # 6. SFT of the student on the dataset.
        self._step = "SFT (training)"
        trained: TrainResult = await workflow.execute_child_workflow(
            TrainWorkflow.run,
            TrainInput(
                team=params.team,
                recipe=params.recipe,
                name="synthetic-sft",
                overrides=[
                    f"init.parent={params.student_uri}",
                    *band.get("sft_overrides", []),
                    *params.sft_overrides,
                ],
                gpus_per_replica=params.gpus,
                gpu_type=params.gpu_type,
                python=params.python,
                timeout_s=params.job_timeout_s,
                checkpoint_wait_s=params.checkpoint_wait_s,
                labels={AUTO_EVAL_LABEL: "false"},
                caller=params.caller,
                auto_eval=False,
            ),
            id=f"{wid}-sft",
            retry_policy=RetryPolicy(maximum_attempts=1),
        )
        assert trained.checkpoint is not None
        result.checkpoint_uri, result.sft_job_id = trained.checkpoint.uri, trained.job_id
        # 7. Held-out eval, before and after.
        result.heldout = await self._stage(
            params,
            "heldout",
            [
                ("base", params.student_uri),
                ("tuned", trained.checkpoint.uri),
                ("templates", ",".join(params.heldout_templates)),
                ("problems", str(params.heldout_problems)),
                ("seed", str(params.seed)),
            ],
        )
        tuned = result.heldout.get("tuned", {})
        return await self._end(
            params,
            "trained",
            f"trained on {result.stages['band'].get('kept', 0)} problems ({result.dataset.get('tokens', 0)} tokens); "
            f"held-out accuracy {tuned.get('accuracy')} (before: {result.heldout.get('base', {}).get('accuracy')})",
        )

    async def _deploy_student(self, params: SyntheticInput, student: dict[str, Any]) -> None:
        """The student served by a deployment's replicas (``promotion_serve``, then its status until
        ready), noted in ``student`` (``model``, then ``deployment``) as soon as it may exist, so
        the caller drains it whatever happens next; ``student`` stays empty when promotions deploy
        nothing here. Not ready in time: the run fails saying why."""
        self._step = "student deployment"
        student["model"] = str(student_ref(params.student_model, workflow.info().workflow_id))
        served = await serve_version(self._act, student["model"], params.student_uri, DEPLOY_POLL_S)
        if not served.deployment:
            student.clear()
            return
        student["deployment"] = served.deployment
        if not served.ready:
            raise ApplicationError(
                f"the student's deployment {served.deployment} was not ready within "
                f"{served.ready_timeout_s:g} s: {served.message}",
                type="StudentNotServed",
                non_retryable=True,
            )

    async def _end(self, params: SyntheticInput, outcome: str, message: str) -> SyntheticResult:
        """8. The summary file and the MLflow run's record; the result."""
        assert self._result is not None
        result = self._result
        result.outcome, result.message = outcome, message
        self._step = f"recording ({outcome})"
        summary = dataclasses.asdict(result)
        path: str = await self._act(
            SyntheticActivities.write_summary, WriteInput(join(result.work_dir, "summary.json"), summary)
        )
        metrics = _flat("stage", result.stages) | _flat(
            "teacher", {k: v for k, v in result.teacher.items() if k != "reasons"}
        )
        metrics |= {f"pass_rate/{b}": float(n) for b, n in result.histogram.items()}
        metrics |= _flat("heldout", {k: v for k, v in result.heldout.items() if k != "job_id"})
        artifacts = [path]
        if result.dataset.get("lineage"):
            artifacts.append(str(result.dataset["lineage"]))
        tags = {"forge.outcome": outcome, "forge.reason": message[:2000]}
        if result.dataset:
            tags |= {"forge.dataset_hash": str(result.dataset.get("content_hash", "")),
                     "forge.dataset_uri": str(result.dataset.get("uri", ""))}  # fmt: skip
        if result.checkpoint_uri:
            tags["forge.checkpoint_uri"] = result.checkpoint_uri
        await self._act(
            SyntheticActivities.track,
            TrackInput(
                workflow.info().workflow_id,
                metrics=metrics,
                tags=tags,
                artifacts=artifacts,
                status="FINISHED",
                histogram=result.histogram,
                band=[params.band_low, params.band_high],
            ),
        )
        self._step = f"done: {outcome}"
        return result


def _flat(prefix: str, data: dict[str, Any]) -> dict[str, float]:
    """Numbers of a nested dict as ``prefix/a/b`` metrics."""
    out: dict[str, float] = {}
    for key, value in data.items():
        name = f"{prefix}/{key}"
        if isinstance(value, dict):
            out |= _flat(name, value)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = float(value)
    return out


#: Every workflow the synthetic worker runs: the pipeline and its children.
SYNTHETIC_WORKFLOWS: tuple[type, ...] = (SyntheticWorkflow, TrainWorkflow, JobWorkflow)
