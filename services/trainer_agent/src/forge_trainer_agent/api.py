"""gRPC servicer of ``forge.trainer.v1.TrainerAgentService``: translation only."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import grpc
from forge.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from google.protobuf import timestamp_pb2

from forge_kit.paging import decode_page, page_info
from forge_trainer_agent.service import AgentService
from forge_trainer_agent.store import RunRow


def _ts(value: dt.datetime | None) -> timestamp_pb2.Timestamp | None:
    if value is None:
        return None
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(value.replace(tzinfo=dt.UTC))
    return stamp


def run_to_proto(row: RunRow, export_dir: Path | None = None) -> trainer_pb2.Run:
    checkpoint = None
    if row.last_checkpoint_uri:
        manifest = row.last_checkpoint_uri
        checkpoint = trainer_pb2.Checkpoint(
            step=row.last_checkpoint_step,
            uri=manifest.rsplit("/", 1)[0],
            manifest_uri=manifest,
            created_at=_ts(row.last_checkpoint_at),
            export_uri=str(export_dir) if export_dir is not None else "",
        )
    return trainer_pb2.Run(
        run_id=row.run_id,
        job_id=row.job_id,
        state=row.state,  # type: ignore[arg-type]
        step=row.step,
        gpu_indices=list(row.gpu_indices),
        started_at=_ts(row.started_at),
        last_checkpoint=checkpoint,
    )


class TrainerAgentApi(trainer_pb2_grpc.TrainerAgentServiceServicer):
    """Translates TrainerAgentService RPCs to :class:`AgentService` calls."""

    def __init__(self, service: AgentService, *, max_page_size: int) -> None:
        self._service = service
        self._max_page_size = max_page_size

    async def GetNodeStatus(
        self, request: trainer_pb2.GetNodeStatusRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.GetNodeStatusResponse:
        status = await self._service.node_status()
        return trainer_pb2.GetNodeStatusResponse(
            node_name=status.node.name,
            node_id=status.node_id,
            gpus=[g.to_proto() for g in status.node.gpus],
            connected=status.connected,
            running=[run_to_proto(r) for r in status.running],
        )

    async def ListRuns(
        self, request: trainer_pb2.ListRunsRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.ListRunsResponse:
        size, offset = decode_page(request.page, max_size=self._max_page_size)
        runs, total = await self._service.list_runs(request.job_id, size, offset)
        return trainer_pb2.ListRunsResponse(
            runs=[run_to_proto(r, self._service.export_dir(r.job_id)) for r in runs],
            page=page_info(offset, len(runs), total),
        )
