"""The ``deployment`` workflow: the one durable driver of a model deployment.

A reconcile loop, every ``poll_s`` or at once on a signal:

1. observe: each replica job's state and endpoint from the scheduler, and whether it answers
   ``/v1/models`` listing the model (``deploy_observe``);
2. route: a replica that runs and answers goes into the gateway's replica pool; one that is
   preempted back to the queue or ends leaves it at once, one that stops answering once it has not
   answered for ``UNANSWERED_S`` (a replica busy generating on loaded cores can miss a probe or two:
   the gateway's own ejection covers short hiccups, and taking the deployment's last replica out of
   the pool on one missed probe turns load into refusals); one that runs but never
   answers within ``ready_timeout_s`` is cancelled; an ended replica (crashed, ``kill -9``,
   node lost) is dropped, and step 4 places its replacement;
3. with ``autoscale``, desired = the gateway's desired replica count for the model (it counts the
   replicas' ``vllm:num_requests_waiting`` and running and its own queue), within min and max:
   at once when it is higher, once it has stayed lower for ``scale_down_delay_s`` when lower;
4. place or drain: fewer live replicas than desired → submit replica jobs (``JOB_KIND_INFERENCE``,
   priority class ``production``: the scheduler places them on the inference pool first, never
   holds them back by quota, never preempts them for training); more → drain the surplus,
   pending ones first, then the newest: out of the gateway's pool first, cancelled ``drain_s``
   later (the engine finishes its admitted requests on SIGTERM).

Signals: ``scale`` (desired replicas, clamped to min..max) and ``undeploy`` (desired 0; the
workflow ends once every replica is gone). Cancelling the workflow drains every replica too.
Query ``deployment``: :class:`DeploymentStatus`. The history is bounded by continuing as new
every ``_ROUNDS_PER_RUN`` rounds, carrying the replicas.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import is_cancelled_exception

with workflow.unsafe.imports_passed_through():
    from forge_orchestrator.activities import CancelJobInput, SubmitJobInput
    from forge_orchestrator.deploy.activities import ObserveInput, ObserveResult, RouteInput
    from forge_orchestrator.deploy.model import (
        DEPLOYMENT_LABEL,
        SCALE_SIGNAL,
        STATUS_QUERY,
        UNDEPLOY_SIGNAL,
        DeploymentInput,
        DeploymentStatus,
        Replica,
        replica_command,
    )
    from forge_orchestrator.inbox import ACTIVITY_RETRY, ACTIVITY_TIMEOUT

_ROUNDS_PER_RUN = 400
_ENDED = frozenset({"SUCCEEDED", "FAILED", "CANCELLED", "GONE"})
#: How long a replica out of the gateway's pool keeps running before it is stopped: the other
#: gateway replicas re-read the pool within this (their ``replica_sync_s``).
DRAIN_S = 5.0
#: How long a ready replica whose job still runs may leave the orchestrator's probes unanswered
#: before it is taken out of the gateway's pool.
UNANSWERED_S = 30.0


@dataclass
class Carried:
    """State carried into the next run when the workflow continues as new."""

    desired: int
    serial: int
    replicas: list[Replica] = field(default_factory=list)
    undeploying: bool = False
    message: str = ""
    drain_at: dict[str, float] = field(default_factory=dict)


@workflow.defn(name="deployment")
class DeploymentWorkflow:
    def __init__(self) -> None:
        self._spec: DeploymentInput | None = None
        self._desired = 0
        self._serial = 0
        self._replicas: list[Replica] = []
        self._undeploying = False
        self._wake = False
        self._state = "deploying"
        self._message = ""
        self._drain_at: dict[str, float] = {}
        self._low_since = 0.0

    @workflow.signal(name=SCALE_SIGNAL)
    def scale(self, replicas: int) -> None:
        if self._spec is not None and not self._undeploying:
            self._desired = max(self._spec.min_replicas, min(self._spec.max_replicas, int(replicas)))
            self._message = f"scaled to {self._desired} replicas"
        self._wake = True

    @workflow.signal(name=UNDEPLOY_SIGNAL)
    def undeploy(self) -> None:
        self._undeploying = True
        self._wake = True

    @workflow.query(name=STATUS_QUERY)
    def status(self) -> DeploymentStatus:
        assert self._spec is not None
        return DeploymentStatus(
            spec=self._spec,
            desired_replicas=0 if self._undeploying else self._desired,
            state=self._state,
            message=self._message,
            replicas=list(self._replicas),
        )

    async def _call(self, name: str, arg: object, result_type: type | None = None) -> object:
        return await workflow.execute_activity(
            name,
            arg,
            start_to_close_timeout=ACTIVITY_TIMEOUT,
            retry_policy=ACTIVITY_RETRY,
            result_type=result_type,
        )

    @workflow.run
    async def run(self, spec: DeploymentInput, carried: Carried | None = None) -> DeploymentStatus:
        self._spec = spec
        if carried is not None:
            self._desired, self._serial = carried.desired, carried.serial
            self._replicas, self._undeploying = carried.replicas, carried.undeploying
            self._message, self._drain_at = carried.message, carried.drain_at
        else:
            self._desired = spec.replicas or spec.min_replicas
            await self._call("ensure_team", spec.team)
        try:
            for _ in range(_ROUNDS_PER_RUN):
                await self._reconcile(spec)
                if self._undeploying and not self._replicas:
                    self._state = "undeployed"
                    return self.status()
                self._wake = False
                with contextlib.suppress(TimeoutError):
                    await workflow.wait_condition(lambda: self._wake, timeout=timedelta(seconds=spec.poll_s))
        except BaseException as exc:
            if not is_cancelled_exception(exc):
                raise
            # Cancelled: nothing may keep serving or holding GPUs for a deployment no one drives.
            await self._remove_all()
            raise
        workflow.continue_as_new(
            args=[
                spec,
                Carried(
                    self._desired,
                    self._serial,
                    self._replicas,
                    self._undeploying,
                    self._message,
                    self._drain_at,
                ),
            ]
        )

    async def _remove_all(self) -> None:
        for replica in self._replicas:
            if replica.state == "ready":
                await self._call("deploy_route", RouteInput(replica.endpoint, add=False))
            await self._call("cancel_job", CancelJobInput(replica.job_id, "the deployment was cancelled"))

    async def _reconcile(self, spec: DeploymentInput) -> None:
        now = workflow.time()
        if self._replicas:
            observed = await self._call(
                "deploy_observe",
                ObserveInput([r.job_id for r in self._replicas], spec.model, spec.replica_token),
                ObserveResult,
            )
            assert isinstance(observed, ObserveResult)
            by_id = {o.job_id: o for o in observed.replicas}
            for replica in list(self._replicas):
                seen = by_id.get(replica.job_id)
                if seen is not None:
                    await self._follow(
                        spec, replica, seen.state, seen.endpoint, seen.healthy, seen.message, now
                    )
                    replica.node = seen.node
        if spec.autoscale and not self._undeploying:
            wanted = await self._call("deploy_autoscale", spec.model, int)
            assert isinstance(wanted, int)
            if wanted >= 0:
                self._autoscale(spec, max(spec.min_replicas, min(spec.max_replicas, wanted)), now)
        target = 0 if self._undeploying else self._desired
        live = [r for r in self._replicas if r.state != "draining"]
        for _ in range(target - len(live)):
            await self._place(spec)
        surplus = len(live) - target
        if surplus > 0:
            # Pending replicas first (they serve nothing), then the newest.
            order = [r for r in reversed(live) if r.state != "ready"] + [
                r for r in reversed(live) if r.state == "ready"
            ]
            for replica in order[:surplus]:
                await self._drain(replica, now, "scaled down" if not self._undeploying else "undeployed")
        for replica in self._replicas:
            due = self._drain_at.get(replica.job_id)
            if replica.state == "draining" and due is not None and now >= due:
                del self._drain_at[replica.job_id]
                await self._call("cancel_job", CancelJobInput(replica.job_id, "drained from the deployment"))
        ready = sum(1 for r in self._replicas if r.state == "ready")
        if self._undeploying:
            self._state = "undeploying"
        else:
            self._state = "ready" if ready >= target else "deploying"

    def _autoscale(self, spec: DeploymentInput, wanted: int, now: float) -> None:
        if wanted >= self._desired:
            self._low_since = 0.0
            if wanted > self._desired:
                self._message = f"autoscaled up to {wanted} replicas"
            self._desired = wanted
        elif not self._low_since:
            self._low_since = now
        elif now - self._low_since >= spec.scale_down_delay_s:
            self._low_since = 0.0
            self._desired = wanted
            self._message = f"autoscaled down to {wanted} replicas"

    async def _follow(
        self,
        spec: DeploymentInput,
        replica: Replica,
        state: str,
        endpoint: str,
        healthy: bool,
        message: str,
        now: float,
    ) -> None:
        """Step 2 of the module docstring for one replica."""
        if state in _ENDED:
            if replica.state == "ready":
                await self._call("deploy_route", RouteInput(replica.endpoint, add=False))
            if replica.state != "draining":
                self._message = f"replica {replica.job_id} ended {state}: {message}"
            self._replicas.remove(replica)
            self._drain_at.pop(replica.job_id, None)
            return
        if replica.state == "draining":
            return
        if replica.state == "ready" and healthy:
            replica.silent_since = 0.0
        elif replica.state == "ready" and endpoint == replica.endpoint:
            replica.silent_since = replica.silent_since or now
            if now - replica.silent_since < UNANSWERED_S:
                return
        if replica.state == "ready" and (not healthy or endpoint != replica.endpoint):
            await self._call("deploy_route", RouteInput(replica.endpoint, add=False))
            replica.state, replica.silent_since = "pending", 0.0
            self._message = f"replica {replica.job_id} left the pool ({state}: {message})"
        if healthy and replica.state != "ready":
            await self._call("deploy_route", RouteInput(endpoint, spec.replica_token, add=True))
            replica.state, replica.endpoint = "ready", endpoint
            self._message = f"replica {replica.job_id} ready at {endpoint}"
            return
        if state == "RUNNING" and replica.state != "ready":
            replica.endpoint = endpoint
            replica.running_since = replica.running_since or now
            if now - replica.running_since > spec.ready_timeout_s:
                self._message = f"replica {replica.job_id} did not answer within {spec.ready_timeout_s:g}s"
                await self._drain(replica, now - DRAIN_S, "never became ready")
        elif state != "RUNNING":
            replica.running_since = 0.0

    async def _place(self, spec: DeploymentInput) -> None:
        self._serial += 1
        run = replica_command(spec)
        job_id = await self._call(
            "submit_job",
            SubmitJobInput(
                name=f"{spec.name}-r{self._serial}",
                team=spec.team,
                command=run.command,
                env=run.env,
                request_id=f"{workflow.info().workflow_id}-replica-{self._serial}",
                priority_class="production",
                kind="inference",
                labels={DEPLOYMENT_LABEL: spec.name},
                gpu_count=spec.gpu_count,
                gpu_type=spec.gpu_type,
                auto_eval=False,
            ),
            str,
        )
        assert isinstance(job_id, str)
        self._replicas.append(Replica(job_id))

    async def _drain(self, replica: Replica, now: float, why: str) -> None:
        if replica.state == "ready":
            await self._call("deploy_route", RouteInput(replica.endpoint, add=False))
            self._drain_at[replica.job_id] = now + DRAIN_S
        else:
            self._drain_at[replica.job_id] = now
        replica.state = "draining"
        self._message = f"replica {replica.job_id} draining: {why}"
