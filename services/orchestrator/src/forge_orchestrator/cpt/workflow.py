"""The ``cpt`` workflow: continual pre-training of a base checkpoint on a domain corpus with
general replay, the mixture chosen by a search and the checkpoint by the input's rule.

In steps (the anchors: Ibrahim et al. 2024 — re-warm and re-decay the LR, replay a few per cent
of general data; data-mixing laws — fit the mixture on short runs):

1. **Base**: register the base checkpoint in eval's registry (``<model_name>:<id>.base``) and
   run the domain and the general suite on it. Where promotions roll replicas
   (:mod:`forge_orchestrator.deploy.rollout`) every measured checkpoint is served by a
   deployment first, ready before its runs, which score it through eval's default endpoint (the
   gateway, pinned by ``name:version``); the deployment is undeployed once both runs ended, and
   replicas not ready in time fail the workflow (``ReplicasNotReady``). Elsewhere each run is on
   a model server eval starts for it;
2. **Mixture search**: one child ``sweep`` workflow per replay fraction, all side by side, each
   searching the peak LRs on ``search_fraction`` of the budget with the LR re-warmed and
   re-decayed (:func:`forge_experiments.cptmix.sweep_space`) and early stopping on the domain
   ``val_loss`` (so LRs compete within a fraction; no fraction is stopped for replaying);
   each sweep waits for its trials' published checkpoints;
3. **Measurement**: every completed search run is registered and scored on both suites; eval's
   CompareRuns against the base gives forgetting (general bits per byte minus the base's) and
   domain gain with paired-bootstrap intervals over the same documents;
4. **Mixture**: :func:`forge_experiments.cptmix.select` with the input's rule over the search points;
   when none is admissible the workflow reports and ends (``none_admissible``, no final run);
5. **Final run**: a child ``training`` workflow at the chosen fraction and peak for the whole
   token budget (the schedule re-warmed and re-decayed over it), measured as in 3;
6. **Checkpoint**: the rule over every measured checkpoint (search and final), on the
   domain-gain / forgetting Pareto front;
7. **Report**: ``mixture.md``, ``mixture.png`` and ``summary.json``, and the MLflow parent run
   (``cpt_report`` activity);
8. **Hand-over**: a child ``eval_and_promote`` for the chosen checkpoint on the domain suite
   (``promote``), its lineage's parent the base.

Cancelling, failing or terminating the workflow cancels its sweeps and final run (their jobs
with them: ``REQUEST_CANCEL``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    import yaml

    from forge_experiments import cptmix
    from forge_experiments.jobcmd import render_value
    from forge_kit.modelref import ModelRef
    from forge_orchestrator.cpt.activities import CptActivities, ReportInput, ReportOutput
    from forge_orchestrator.cpt.model import (
        CptInput,
        CptResult,
        budgets,
        fixed_overrides,
        space_of,
        validate_cpt,
    )
    from forge_orchestrator.deploy.promotion import Served
    from forge_orchestrator.deploy.rollout import drain_version, serve_version
    from forge_orchestrator.eval_activities import (
        Comparison,
        EvalActivities,
        ModelId,
        RegisterInput,
        RunInput,
        RunState,
    )
    from forge_orchestrator.identity import ADMIN
    from forge_orchestrator.inbox import ACTIVITY_RETRY, PROGRESS_QUERY
    from forge_orchestrator.promote.model import EvalAndPromoteInput, EvalAndPromoteResult
    from forge_orchestrator.promote.workflow import (
        EVAL_ACTIVITY_TIMEOUT,
        EvalAndPromoteWorkflow,
        wait_eval_run,
    )
    from forge_orchestrator.sweep.activities import TRACK_RETRY, TRACK_TIMEOUT
    from forge_orchestrator.sweep.model import MEMO_METRIC, SweepInput, SweepResult
    from forge_orchestrator.sweep.workflow import SweepWorkflow
    from forge_orchestrator.training.model import TrainInput, TrainResult
    from forge_orchestrator.training.workflow import TrainWorkflow

#: The eval metric both suites report per document (perplexity tasks; lower is better).
METRIC = "bits_per_byte"
#: ``workflow.patched`` marker of the measurement runs on deployments (histories from before it
#: replay with eval's own model servers).
MEASURES_ON_REPLICAS = "cpt-measures-on-replicas"


class _Measured:
    """One checkpoint's two suite runs, and whether this workflow deployed it for them."""

    def __init__(self, model: ModelId, runs: dict[str, str], deployed: bool = False) -> None:
        self.model, self.runs, self.deployed = model, runs, deployed


@workflow.defn(name="cpt")
class CptWorkflow:
    def __init__(self) -> None:
        self._step = "starting"
        self._points: list[cptmix.Point] = []
        self._sweeps: list[str] = []
        self._runs: dict[str, str] = {}
        self._mixture: dict[str, Any] = {}
        self._deployments: dict[str, str] = {}

    @workflow.query(name=PROGRESS_QUERY)
    def progress(self) -> dict[str, Any]:
        return {
            "step": self._step,
            "sweeps": list(self._sweeps),
            "points": [p.as_dict() for p in self._points],
            "mixture": dict(self._mixture),
            "eval_runs": dict(self._runs),
            "deployments": dict(self._deployments),
        }

    async def _call(self, method: Any, *args: object) -> Any:
        return await workflow.execute_activity_method(
            method, args=list(args), start_to_close_timeout=EVAL_ACTIVITY_TIMEOUT, retry_policy=ACTIVITY_RETRY
        )

    # Measurement.

    async def _start(self, params: CptInput, model: ModelId, uri: str, parent: str) -> _Measured:
        await self._call(
            EvalActivities.register_model,
            RegisterInput(
                model=model,
                uri=uri,
                labels={"workflow_id": workflow.info().workflow_id, "recipe": params.recipe},
                parent=parent,
            ),
        )
        serve, deployed = True, False
        if workflow.patched(MEASURES_ON_REPLICAS):
            served: Served = await serve_version(self._call, str(model), uri, params.eval_poll_s)
            deployed = served.created
            if served.deployment and not served.ready:
                if deployed:
                    await drain_version(self._call, str(model), params.eval_poll_s)
                raise ApplicationError(
                    f"the replicas of {model} ({served.deployment}) were not ready within "
                    f"{served.ready_timeout_s:g}s: {served.message}",
                    type="ReplicasNotReady",
                    non_retryable=True,
                )
            serve = not served.deployment
            if served.deployment:
                self._deployments[str(model)] = served.deployment
        runs = {}
        for suite in (params.domain_suite, params.general_suite):
            runs[suite] = await self._call(
                EvalActivities.run_suite,
                RunInput(
                    model=model,
                    suite=suite,
                    limit=params.eval_limit,
                    seed=params.eval_seed,
                    tier=params.eval_tier,
                    serve_model=serve,
                ),
            )
        return _Measured(model, runs, deployed)

    async def _wait(self, params: CptInput, run_id: str) -> RunState:
        return await wait_eval_run(self._call, run_id, params.eval_poll_s, params.eval_timeout_s, self._runs)

    async def _finished(self, params: CptInput, measured: _Measured) -> dict[str, RunState]:
        """Both runs of ``measured``, ended; the deployment made for them undeployed."""
        try:
            return {s: await self._wait(params, r) for s, r in measured.runs.items()}
        finally:
            if measured.deployed:
                await drain_version(self._call, str(measured.model), params.eval_poll_s)
                self._deployments.pop(str(measured.model), None)

    async def _point(
        self,
        params: CptInput,
        base: _Measured,
        measured: _Measured,
        label: str,
        fraction: float,
        lr: float,
        steps: int,
        stage: str,
        uri: str,
    ) -> cptmix.Point:
        losses: dict[str, cptmix.Loss] = {}
        deltas: dict[str, tuple[float, float, float]] = {}
        states = await self._finished(params, measured)
        for suite in (params.domain_suite, params.general_suite):
            state = states[suite]
            if METRIC not in state.metrics:
                raise ApplicationError(
                    f"suite {suite} reports no {METRIC} (a perplexity task is needed)",
                    type="NoPerplexity",
                    non_retryable=True,
                )
            low, high = state.intervals.get(METRIC, [state.metrics[METRIC]] * 2)
            losses[suite] = cptmix.Loss(state.metrics[METRIC], (low, high), params.eval_limit)
            comparison: Comparison = await self._call(
                EvalActivities.compare_runs, base.runs[suite], measured.runs[suite]
            )
            delta = comparison.deltas.get(METRIC)
            if delta is None:
                raise ApplicationError(
                    f"comparison of {measured.model} with the base on {suite} has no {METRIC}",
                    type="NoComparison",
                    non_retryable=True,
                )
            lo, hi = comparison.intervals.get(METRIC, [delta, delta])
            deltas[suite] = (delta, lo, hi)
        return cptmix.compared_point(
            label,
            fraction,
            lr,
            steps,
            domain=losses[params.domain_suite],
            general=losses[params.general_suite],
            domain_delta=deltas[params.domain_suite],
            general_delta=deltas[params.general_suite],
            stage=stage,
            uri=uri,
            extra={"model": str(measured.model)},
        )

    # The run.

    @workflow.run
    async def run(self, params: CptInput) -> CptResult:
        try:
            validate_cpt(params)
        except Exception as exc:  # noqa: BLE001 - the API checked it; an old or forged input
            raise ApplicationError(f"bad input: {exc}", type="BadInput", non_retryable=True) from None
        wid = workflow.info().workflow_id
        tag = wid.replace(":", "_")  # model versions take no ':'
        caller = params.caller or ADMIN
        search_steps, final_steps = budgets(params)
        # 1. The base.
        self._step = "measuring the base"
        base = await self._start(params, ModelId(params.model_name, f"{tag}.base"), params.base, "")
        base_states = await self._finished(params, base)
        base_row = {
            "label": "base",
            "uri": params.base,
            "model": str(base.model),
            "domain_loss": base_states[params.domain_suite].metrics.get(METRIC),
            "general_loss": base_states[params.general_suite].metrics.get(METRIC),
        }
        # 2. The mixture search: a sweep per replay fraction, side by side.
        self._step = f"mixture search: {len(params.search.general_fractions)} sweeps"
        children = []
        for i, fraction in enumerate(params.search.general_fractions):
            space = yaml.safe_dump(space_of(params, wid, i, fraction, search_steps), sort_keys=False)
            self._sweeps.append(f"{wid}-f{i}")
            children.append(
                workflow.execute_child_workflow(
                    SweepWorkflow.run,
                    SweepInput(
                        space=space,
                        team=params.team,
                        python=params.python,
                        caller=caller,
                        checkpoint_wait_s=params.checkpoint_wait_s,
                    ),
                    id=f"{wid}-f{i}",
                    memo={MEMO_METRIC: "val_loss"},
                    parent_close_policy=workflow.ParentClosePolicy.REQUEST_CANCEL,
                )
            )
        sweeps: list[SweepResult] = list(await asyncio.gather(*children))
        # 3. Measure every completed search run.
        self._step = "measuring the search runs"
        started: list[tuple[_Measured, str, float, float, int, str]] = []
        unmeasured: list[str] = []
        for i, (fraction, swept) in enumerate(zip(params.search.general_fractions, sweeps, strict=True)):
            for trial in swept.trials:
                lr = float(trial.params["optim.lr"])
                if trial.state == "completed" and not trial.checkpoint_uri:
                    unmeasured.append(
                        f"f={fraction:g} lr={lr:g}: no checkpoint within {params.checkpoint_wait_s:g}s"
                    )
                if trial.state != "completed" or not trial.checkpoint_uri:
                    continue
                model = ModelId(params.model_name, f"{tag}.f{i}-t{trial.index}")
                measured = await self._start(params, model, trial.checkpoint_uri, str(base.model))
                started.append(
                    (
                        measured,
                        f"search f={fraction:g} lr={lr:g}",
                        fraction,
                        lr,
                        search_steps,
                        trial.checkpoint_uri,
                    )
                )
        for measured, label, fraction, lr, steps, uri in started:
            self._points.append(
                await self._point(params, base, measured, label, fraction, lr, steps, "search", uri)
            )
        # 4. The mixture.
        mixture = cptmix.select(self._points, params.rule)
        self._mixture = {"reason": mixture.reason}
        result = CptResult(outcome="none_admissible", reason=mixture.reason, sweeps=list(self._sweeps))
        if mixture.chosen is not None:
            best = self._points[mixture.chosen]
            self._mixture.update(general_fraction=best.general_fraction, lr=best.lr)
            # 5. The final run at the chosen mixture, the whole budget.
            self._step = (
                f"final run: replay {best.general_fraction:g}, peak LR {best.lr:g}, {final_steps} steps"
            )
            values = {
                **fixed_overrides(params),
                **params.search.overrides(final_steps),
                **params.search.run_overrides(best.general_fraction, best.lr),
                "max_steps": final_steps,
            }
            result.final_workflow_id = f"{wid}-final"
            trained: TrainResult = await workflow.execute_child_workflow(
                TrainWorkflow.run,
                TrainInput(
                    team=params.team,
                    recipe=params.recipe,
                    name=f"{wid}-final"[:128],
                    overrides=[f"{k}={render_value(v)}" for k, v in values.items()],
                    gpus_per_replica=params.gpus_per_trial,
                    gpu_type=params.gpu_type,
                    python=params.python,
                    timeout_s=params.job_timeout_s,
                    checkpoint_wait_s=params.checkpoint_wait_s,
                    caller=caller,
                    auto_eval=False,
                ),
                id=result.final_workflow_id,
                parent_close_policy=workflow.ParentClosePolicy.REQUEST_CANCEL,
            )
            if trained.checkpoint is None or not trained.checkpoint.uri:
                raise ApplicationError(
                    "the final run published no model", type="NoCheckpoint", non_retryable=True
                )
            self._step = "measuring the final run"
            uri = trained.checkpoint.uri
            measured = await self._start(
                params, ModelId(params.model_name, f"{tag}.final"), uri, str(base.model)
            )
            self._points.append(
                await self._point(
                    params,
                    base,
                    measured,
                    f"final {trained.checkpoint.step} steps",
                    best.general_fraction,
                    best.lr,
                    trained.checkpoint.step,
                    "final",
                    uri,
                )
            )
        # 6. The checkpoint.
        summary = cptmix.summary(
            self._points,
            params.rule,
            base_row,
            name=wid,
            units=f"eval {METRIC}",
            mixture=dict(self._mixture),
            search={"steps": search_steps, "sweeps": list(self._sweeps), "unmeasured": unmeasured},
            final={"steps": final_steps, "workflow_id": result.final_workflow_id}
            if result.final_workflow_id
            else {},
        )
        result.mixture, result.curve, result.front = dict(self._mixture), summary["curve"], summary["front"]
        if mixture.chosen is not None:  # the mixture's own point is still admissible: a choice
            result.outcome, result.reason, result.chosen = (
                summary["outcome"],
                summary["reason"],
                summary["chosen"],
            )
        # 7. The report.
        self._step = "report"
        report: ReportOutput = await workflow.execute_activity_method(
            CptActivities.report,
            ReportInput(
                workflow_id=wid,
                out_dir=params.report_dir,
                summary=summary,
                params={
                    "base": params.base,
                    "domain_corpus": params.domain_corpus,
                    "general_corpus": params.general_corpus,
                    "token_budget": str(params.token_budget),
                    "rule": summary["rule"]["text"],
                    "search": repr(params.search),
                },
                sweep_runs=[s.parent_run_id for s in sweeps],
                time_ms=int(workflow.now().timestamp() * 1000),
            ),
            start_to_close_timeout=TRACK_TIMEOUT,
            retry_policy=TRACK_RETRY,
        )
        result.report = {
            "markdown": report.markdown,
            "png": report.png,
            "json": report.json,
            "run_id": report.run_id,
            "run_url": report.run_url,
        }
        # 8. The hand-over.
        if result.chosen is not None and params.promote:
            self._step = "hand-over: eval_and_promote"
            version = ModelRef.parse(str(result.chosen["extra"]["model"])).version
            handover_id = f"{wid}-promote"
            promoted: EvalAndPromoteResult = await workflow.execute_child_workflow(
                EvalAndPromoteWorkflow.run,
                EvalAndPromoteInput(
                    model_name=params.model_name,
                    model_version=version,
                    uri=str(result.chosen["uri"]),
                    suite=params.domain_suite,
                    limit=params.eval_limit,
                    seed=params.eval_seed,
                    poll_s=params.eval_poll_s,
                    run_timeout_s=params.eval_timeout_s,
                    tier=params.promote_tier,
                    parent=str(base.model),
                ),
                id=handover_id,
            )
            result.handover = {
                "workflow_id": handover_id,
                "decision": promoted.decision,
                "promoted_to": promoted.promoted_to,
                "reason": promoted.blocked_reason,
            }
        self._step = "done"
        workflow.logger.info("cpt done", extra={"outcome": result.outcome})
        return result
