"""Trainer agent process: settings → node → database → service → scheduler session + servers."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

import structlog
from forge.trainer.v1 import trainer_pb2, trainer_pb2_grpc

from forge_kit.app import ServiceApp
from forge_kit.backoff import Backoff
from forge_kit.grpckit import make_channel
from forge_kit.objectstore import ObjectStore
from forge_kit.paths import DATA_DIR_ENV, data_dir
from forge_trainer_agent.api import TrainerAgentApi
from forge_trainer_agent.checkpoints import CheckpointAnnouncer, ManifestFinder
from forge_trainer_agent.config import TrainerAgentSettings
from forge_trainer_agent.gpus import node_gpus
from forge_trainer_agent.metrics import MetricsStreamer
from forge_trainer_agent.node import ADDRESS_LABEL, EVENT_LOG_LABEL, NodeInfo
from forge_trainer_agent.runner import LocalProcessRunner, TorchrunRunner
from forge_trainer_agent.sandbox import JobSandbox, dataset_folders
from forge_trainer_agent.service import AgentService
from forge_trainer_agent.session import SchedulerSession
from forge_trainer_agent.store import RunStore

log = structlog.get_logger(__name__)


def node_labels(settings: TrainerAgentSettings) -> dict[str, str]:
    """The address jobs' rendezvous listen at and, on a fixed port, where this agent's outbox is
    read (the metrics it published are not lost with a broker that forgets them)."""
    labels = {ADDRESS_LABEL: settings.advertise_address} if settings.advertise_address else {}
    if settings.grpc_port:
        labels[EVENT_LOG_LABEL] = f"{settings.advertise_address or '127.0.0.1'}:{settings.grpc_port}"
    return labels


async def main() -> None:
    settings = TrainerAgentSettings()
    app = ServiceApp(settings)
    detected = await asyncio.to_thread(node_gpus, settings.gpus)
    log.info(
        "agent.gpus",
        source=detected.source,
        count=len(detected.gpus),
        types=sorted({g.type for g in detected.gpus}),
        nvlink_groups=sorted({g.nvlink_group for g in detected.gpus} - {0}),
    )
    node = NodeInfo(
        name=settings.node_name,
        gpus=detected.gpus,
        node_group=settings.node_group,
        rack=settings.rack,
        nvlink_domain=settings.nvlink_domain,
        labels=node_labels(settings),
    )
    db = await app.open_database("trainer_agent.db", Path(__file__).parent / "migrations")
    app.enable_outbox()
    objects = ObjectStore(settings.object_store_url)
    sandbox = JobSandbox(
        bwrap=settings.job_sandbox,
        uid=settings.job_uid,
        gid=settings.job_gid,
        read_paths=[*(p.strip() for p in settings.job_read_paths.split(",")), *map(str, dataset_folders())],
        write_paths=[p.strip() for p in settings.job_write_paths.split(",")],
        objects_root=objects.root_url,
        private=[Path(settings.data_dir)],
    )
    checked = await asyncio.to_thread(sandbox.check)
    isolation = dataclasses.replace(checked, allows_unisolated=settings.allow_unisolated_jobs)
    if isolation.isolated:
        log.info("agent.job_isolation", isolated=True, detail=isolation.detail)
    elif settings.job_sandbox and not settings.allow_unisolated_jobs:
        # Secure by default: a node meant to isolate jobs that cannot does not start at all.
        log.error("agent.job_isolation", isolated=False, detail=isolation.detail, starting=False)
        raise SystemExit(
            f"trainer agent: jobs cannot be isolated here ({isolation.detail}); run the agent as "
            "root with Debian's bubblewrap installed (make install installs it as root), or opt in: "
            "FORGE_TRAINER_AGENT_JOB_SANDBOX='' (admins' jobs only, unisolated) or "
            "FORGE_TRAINER_AGENT_ALLOW_UNISOLATED_JOBS=true (every job, unisolated)"
        )
    else:
        runs = "EVERY job" if settings.allow_unisolated_jobs else "jobs submitted by admins only"
        log.error(
            "agent.job_isolation",
            isolated=False,
            detail=isolation.detail,
            runs=runs,
            warning=f"JOBS ARE NOT ISOLATED on this node (operator's choice): {runs} run as the agent's user",
        )
    used = sandbox if isolation.isolated else None
    # Jobs find the datasets where the agent does, whatever their working directory.
    base_env = {**os.environ, DATA_DIR_ENV: str(data_dir())}
    node = dataclasses.replace(node, isolation=isolation)
    service = AgentService(
        RunStore(db),
        TorchrunRunner(base_env, sandbox=used)
        if settings.runner == "torchrun"
        else LocalProcessRunner(base_env, sandbox=used),
        node,
        runs_dir=Path(settings.data_dir).resolve() / "runs",
        stop_grace_s=settings.stop_grace_s,
        announcer=CheckpointAnnouncer(db, objects, ManifestFinder(objects), producer=app.name),
        objects_url=objects.root_url,
        metrics=MetricsStreamer(db, producer=app.name),
        advertise_address=settings.advertise_address or "127.0.0.1",
    )
    await service.recover()
    channel = make_channel(settings.scheduler_target, token=settings.scheduler_token.get_secret_value())
    session = SchedulerSession(
        service,
        channel,
        register_timeout_s=settings.register_timeout_s,
        backoff=Backoff(settings.reconnect_initial_s, settings.reconnect_max_s),
    )
    app.add_background(session.run)
    app.add_on_stop(lambda: service.shutdown(settings.shutdown_grace_s))
    app.add_on_stop(lambda: channel.close(grace=None))
    api = TrainerAgentApi(service, max_page_size=settings.max_page_size)
    await app.run(
        register=[lambda server: trainer_pb2_grpc.add_TrainerAgentServiceServicer_to_server(api, server)],
        service_names=[trainer_pb2.DESCRIPTOR.services_by_name["TrainerAgentService"].full_name],
    )


if __name__ == "__main__":
    asyncio.run(main())
