"""Orchestrator process: settings → database → Temporal client → worker, job-event consumer, gRPC + HTTP."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

from forge.events.v1 import events_pb2
from forge.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc

from forge_kit.app import ServiceApp
from forge_kit.db import Database
from forge_kit.eventlog import CatchUp, CatchUpSource
from forge_kit.events import TOPICS
from forge_kit.http import make_app
from forge_kit.objectstore import ObjectStore
from forge_orchestrator.activities import SchedulerActivities
from forge_orchestrator.agent_logs import AgentEventLogs
from forge_orchestrator.api import OrchestratorApi
from forge_orchestrator.config import OrchestratorSettings
from forge_orchestrator.cpt.activities import CptActivities
from forge_orchestrator.deploy.activities import DeployActivities
from forge_orchestrator.deploy.promotion import PromotionActivities, promotion_serving
from forge_orchestrator.deploy.service import DeploymentService
from forge_orchestrator.eval_activities import EvalActivities
from forge_orchestrator.event_handlers import (
    CheckpointHandler,
    EventHandlers,
    JobEventHandler,
    PromotionHandler,
    TemporalSignaller,
)
from forge_orchestrator.grant import StartGuard, grant_key
from forge_orchestrator.identity import SchedulerAuthenticator
from forge_orchestrator.promote.canary_activities import CanaryActivities
from forge_orchestrator.rlhf.activities import RlhfActivities
from forge_orchestrator.rlhf.sampling import RlhfSampler
from forge_orchestrator.rlhf.worker import RlhfSettings, build_rlhf_worker, rlhf_task_queue
from forge_orchestrator.service import KINDS, OrchestratorService, build_worker, connect_temporal
from forge_orchestrator.sweep.activities import SweepActivities
from forge_orchestrator.sweep.metrics_handler import MetricsHandler, TemporalSweepSignaller
from forge_orchestrator.synthetic.worker import (
    SyntheticSettings,
    build_synthetic_worker,
    endpoints,
    synthetic_task_queue,
)
from forge_orchestrator.tracking.tracker import Tracker


def catch_up_topics(settings: OrchestratorSettings) -> list[str]:
    """Topics read again from the producers' outboxes: job events, and metrics when the agents'
    outboxes may be read (``trainer_agent_token``)."""
    names = [events_pb2.JobStateChanged.DESCRIPTOR.full_name]
    if settings.trainer_agent_token.get_secret_value():
        names.append(events_pb2.TrainingMetrics.DESCRIPTOR.full_name)
    return [TOPICS[name] for name in names]


def agent_logs(app: ServiceApp, settings: OrchestratorSettings) -> AgentEventLogs | None:
    """The trainer agents' outboxes as catch-up sources (None without ``trainer_agent_token``)."""
    token = settings.trainer_agent_token.get_secret_value()
    if not token:
        return None
    logs = AgentEventLogs(settings.scheduler_target, settings.scheduler_token.get_secret_value(), token)
    app.add_on_stop(logs.close)
    return logs


def add_tracking(app: ServiceApp, db: Database, settings: OrchestratorSettings) -> None:
    """The consumer that records training runs in MLflow (its own group, so it neither delays
    nor is delayed by the workflows' consumer)."""
    from forge_orchestrator.tracking.consumer import RunRecorder, SchedulerJobs, git_commit

    jobs = SchedulerJobs(settings.scheduler_target, settings.scheduler_token.get_secret_value())
    recorder = RunRecorder(
        Tracker(settings.mlflow_uri, ui_url=settings.mlflow_ui_uri),
        jobs,
        objects=ObjectStore(settings.object_store_url),
        code_version=settings.code_version or git_commit(),
    )
    names = (
        events_pb2.JobStateChanged,
        events_pb2.TrainingMetrics,
        events_pb2.CheckpointPublished,
        events_pb2.EvalCompleted,
    )
    # The kit's consumer: broker credentials, signature checks and dedupe come with it.
    consumer = app.event_consumer(
        group_id=settings.tracking_consumer_group,
        topics=[TOPICS[m.DESCRIPTOR.full_name] for m in names],
        handler=recorder.handle,
        session_timeout_ms=settings.consumer_session_timeout_ms,
    )
    app.add_on_stop(jobs.close)
    # Job states the broker lost come from the scheduler's outbox, so runs are made and closed
    # anyway; metrics from the trainer agents' outboxes when this process may read them.
    scheduler = CatchUpSource(
        "scheduler", settings.scheduler_target, settings.scheduler_token.get_secret_value()
    )
    catch_up = CatchUp(
        consumer,
        db,
        group_id=settings.tracking_consumer_group,
        topics=catch_up_topics(settings),
        sources=[scheduler],
        interval_s=settings.catch_up_interval_s,
        discover=agent_logs(app, settings),
    )
    app.add_background(catch_up.run)


async def main() -> None:
    settings = OrchestratorSettings()
    app = ServiceApp(settings)
    db = await app.open_database("orchestrator.db", Path(__file__).parent / "migrations")
    client = await connect_temporal(
        settings.temporal_target,
        settings.temporal_namespace,
        timeout_s=settings.temporal_connect_timeout_s,
        tls=settings.temporal_tls(),
    )
    # Workflows act only when the front door started them (or a parent it started): its grant,
    # signed with a key from this service's own token, is checked before every activity.
    key = grant_key(settings.auth_token.get_secret_value())
    queues = [
        settings.task_queue,
        rlhf_task_queue(settings.task_queue),
        synthetic_task_queue(settings.task_queue),
    ]
    guard = StartGuard(client, key, queues)
    activities = SchedulerActivities(settings.scheduler_target, settings.scheduler_token.get_secret_value())
    eval_activities = EvalActivities(settings.eval_target, settings.eval_token.get_secret_value())
    canary = CanaryActivities(
        settings.canary_metrics_urls(),
        default_family=settings.canary_policy,
        policy_dir=Path(settings.canary_policy_dir) if settings.canary_policy_dir else None,
    )
    # Sweeps record their parent and trial runs where training runs are tracked (none without MLflow).
    tracker = Tracker(settings.mlflow_uri, ui_url=settings.mlflow_ui_uri) if settings.mlflow_uri else None
    sweeps = SweepActivities(db.url, tracker)
    gateway_token = settings.inference_gateway_token.get_secret_value()
    deploys = DeployActivities(
        settings.scheduler_target,
        settings.scheduler_token.get_secret_value(),
        settings.inference_gateway_url or RlhfSettings().gateway_url,
        gateway_token,
    )
    app.add_on_stop(deploys.close)
    deployments = DeploymentService(
        client,
        settings.task_queue,
        forge_python=settings.deploy_forge_python,
        vllm_python=settings.deploy_vllm_python,
        poll_s=settings.deploy_poll_s,
        scale_down_delay_s=settings.deploy_scale_down_delay_s,
        grant_key=key,
    )
    serving = promotion_serving(settings)
    promotions = PromotionActivities(
        deployments,
        serving,
        gateway_url=settings.inference_gateway_url or RlhfSettings().gateway_url,
        gateway_token=gateway_token,
    )
    app.add_background(
        build_worker(
            client,
            settings.task_queue,
            activities,
            eval_activities,
            extra_activities=[*sweeps.methods(), *CptActivities(tracker).methods(), *deploys.methods()],
            canary=canary,
            guard=guard,
            promotions=promotions,
        ).run
    )
    app.add_on_stop(activities.close)
    app.add_on_stop(eval_activities.close)
    kinds = dict(KINDS)
    if RlhfSettings().enabled:
        rlhf_activities = RlhfActivities(
            settings.preference_feedback_target, settings.preference_feedback_token.get_secret_value()
        )
        sampler = RlhfSampler(
            settings.inference_gateway_target,
            settings.inference_gateway_url or RlhfSettings().gateway_url,
            settings.inference_gateway_token.get_secret_value(),
            settings.preference_feedback_target,
            settings.preference_feedback_token.get_secret_value(),
        )
        rlhf_worker = build_rlhf_worker(
            client,
            settings.task_queue,
            activities,
            eval_activities,
            rlhf_activities,
            sampler,
            canary,
            promotions,
            guard=guard,
        )
        app.add_background(rlhf_worker.run)
        app.add_on_stop(rlhf_activities.close)
    else:
        del kinds["rlhf"]
    synthetic = SyntheticSettings()
    if synthetic.enabled:
        teacher, student = endpoints(
            synthetic,
            settings.inference_gateway_url or RlhfSettings().gateway_url,
            settings.inference_gateway_token.get_secret_value(),
        )
        # The student is deployed for its sampling only where it is sampled through the gateway.
        app.add_background(
            build_synthetic_worker(
                client,
                settings.task_queue,
                activities,
                teacher,
                student,
                tracker,
                None if synthetic.student_url else promotions,
                guard=guard,
            ).run
        )
    else:
        del kinds["synthetic"]
    workflows = OrchestratorService(client, settings.task_queue, kinds=kinds, grant_key=key)
    if settings.kafka_enabled:
        signaller = TemporalSignaller(client)
        handlers = EventHandlers(
            job_events=JobEventHandler(signaller),
            checkpoints=CheckpointHandler(
                workflows,
                suite=settings.release_suite,
                limit=settings.release_limit,
                tier=settings.release_tier,
                signaller=signaller,
            ),
            # Every ModelPromoted rolls replicas where promotions deploy (deploy/promoted.py).
            promotions=PromotionHandler(workflows, poll_s=settings.deploy_poll_s) if serving else None,
        )
        topics = [
            events_pb2.JobStateChanged.DESCRIPTOR.full_name,
            events_pb2.CheckpointPublished.DESCRIPTOR.full_name,
            events_pb2.TrainingMetrics.DESCRIPTOR.full_name,
            *([events_pb2.ModelPromoted.DESCRIPTOR.full_name] if serving else []),
        ]
        consumer = app.event_consumer(
            group_id=settings.consumer_group,
            topics=[TOPICS[name] for name in topics],
            handler=MetricsHandler(TemporalSweepSignaller(client), then=handlers.handle).handle,
            session_timeout_ms=settings.consumer_session_timeout_ms,
        )
        # The broker may lose events (the local one keeps nothing across a restart): read job
        # events from the scheduler's outbox too, and trials' metrics from the agents'; the
        # consumer's dedupe applies each once.
        catch_up = CatchUp(
            consumer,
            db,
            group_id=settings.consumer_group,
            topics=catch_up_topics(settings),
            discover=agent_logs(app, settings),
            sources=[
                CatchUpSource(
                    "scheduler", settings.scheduler_target, settings.scheduler_token.get_secret_value()
                )
            ],
            interval_s=settings.catch_up_interval_s,
        )
        app.add_background(catch_up.run)
        if settings.mlflow_uri:
            add_tracking(app, db, settings)

    async def temporal_ready() -> bool:
        return await client.service_client.check_health(timeout=timedelta(seconds=2))

    api = OrchestratorApi(workflows, deployments)
    # Team tokens are the scheduler's: it says whom a presented token acts for.
    callers = SchedulerAuthenticator(settings.scheduler_target)
    app.add_on_stop(callers.close)
    await app.run(
        register=[
            lambda server: orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server(api, server)
        ],
        service_names=[orchestrator_pb2.DESCRIPTOR.services_by_name["OrchestratorService"].full_name],
        http=make_app(app.name, readiness={"database": db.ping, "temporal": temporal_ready}),
        authenticators=[callers],
    )


if __name__ == "__main__":
    asyncio.run(main())
