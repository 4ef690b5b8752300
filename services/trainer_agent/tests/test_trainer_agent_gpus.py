"""GPU detection with NVML faked at its library boundary (the ``pynvml`` functions of
``nvidia-ml-py``), the ``torch.cuda`` fallback, the ``gpus`` override, and a node without GPUs; then
a detected node registered with a real scheduler process, whose jobs see exactly their GPUs."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest
import torch
from forge.common.v1 import common_pb2
from forge.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

from forge_kit.db import Database
from forge_kit.grpckit import make_channel
from forge_kit.testing import ServiceProcess, base_env, eventually, free_port
from forge_trainer_agent.gpus import Detected, detect_gpus, node_gpus
from forge_trainer_agent.node import ADDRESS_LABEL, GpuInfo, NodeInfo
from forge_trainer_agent.runner import LocalProcessRunner
from forge_trainer_agent.service import AgentService
from forge_trainer_agent.session import Backoff, SchedulerSession
from forge_trainer_agent.store import RunStore

MIGRATIONS = Path(__file__).parents[1] / "src" / "forge_trainer_agent" / "migrations"
H100_BYTES = 81559 * 1024 * 1024


class FakeNvml:
    """An 8 x H100 SXM node as NVML describes it: two NVLink islands (0-3, 4-7: NVML's P2P NVLink
    status OK within an island), each pair of GPUs behind one PCIe switch (common ancestor SINGLE),
    each island under one CPU socket (NODE), SYSTEM across sockets."""

    def __init__(self, count: int = 8, *, nvlink: bool = True) -> None:
        self.count = count
        self.nvlink = nvlink
        self.initialised = 0
        self.shutdowns = 0
        self.fail_on: str | None = None

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in (
            "nvmlInit",
            "nvmlShutdown",
            "nvmlDeviceGetCount",
            "nvmlDeviceGetHandleByIndex",
            "nvmlDeviceGetName",
            "nvmlDeviceGetMemoryInfo",
            "nvmlDeviceGetUUID",
            "nvmlDeviceGetPciInfo",
            "nvmlDeviceGetP2PStatus",
            "nvmlDeviceGetTopologyCommonAncestor",
        ):
            monkeypatch.setattr(pynvml, name, getattr(self, name))

    def _maybe_fail(self, name: str) -> None:
        if self.fail_on == name:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    def nvmlInit(self) -> None:
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> SimpleNamespace:
        if not 0 <= index < self.count:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return SimpleNamespace(index=index)

    def nvmlDeviceGetName(self, handle: SimpleNamespace) -> str:
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetMemoryInfo(self, handle: SimpleNamespace) -> SimpleNamespace:
        self._maybe_fail("memory")
        return SimpleNamespace(total=H100_BYTES, free=H100_BYTES, used=0)

    def nvmlDeviceGetUUID(self, handle: SimpleNamespace) -> bytes:
        return f"GPU-0000000{handle.index}-aaaa-bbbb-cccc-dddddddddddd".encode()  # older bindings: bytes

    def nvmlDeviceGetPciInfo(self, handle: SimpleNamespace) -> SimpleNamespace:
        return SimpleNamespace(busId=f"00000000:{0x18 + 0x10 * handle.index:02X}:00.0")

    def nvmlDeviceGetP2PStatus(self, a: SimpleNamespace, b: SimpleNamespace, index: int) -> int:
        assert index == pynvml.NVML_P2P_CAPS_INDEX_NVLINK
        if not self.nvlink:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        same_island = a.index // 4 == b.index // 4
        return pynvml.NVML_P2P_STATUS_OK if same_island else pynvml.NVML_P2P_STATUS_NOT_SUPPORTED

    def nvmlDeviceGetTopologyCommonAncestor(self, a: SimpleNamespace, b: SimpleNamespace) -> int:
        if a.index // 2 == b.index // 2:
            return pynvml.NVML_TOPOLOGY_SINGLE
        if a.index // 4 == b.index // 4:
            return pynvml.NVML_TOPOLOGY_NODE
        return pynvml.NVML_TOPOLOGY_SYSTEM


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    fake = FakeNvml()
    fake.install(monkeypatch)
    return fake


def _no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine's real state here: no NVIDIA driver, so nvmlInit cannot load libnvidia-ml."""

    def missing() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", missing)


def test_nvml_reports_type_memory_ids_and_topology(nvml: FakeNvml) -> None:
    found = detect_gpus()

    assert found.source == "nvml"
    assert [(g.index, g.type, g.memory_mb) for g in found.gpus] == [(i, "H100", 81559) for i in range(8)]
    assert found.gpus[3].uuid == "GPU-00000003-aaaa-bbbb-cccc-dddddddddddd"
    assert found.gpus[1].pci_bus_id == "00000000:28:00.0"
    assert [g.nvlink_group for g in found.gpus] == [1, 1, 1, 1, 2, 2, 2, 2]
    assert [g.pcie_group for g in found.gpus] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert (nvml.initialised, nvml.shutdowns) == (1, 1)
    proto = found.gpus[5].to_proto()
    assert (proto.uuid, proto.nvlink_group, proto.pcie_group) == (found.gpus[5].uuid, 2, 3)


def test_pcie_only_gpus_have_no_nvlink_group(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml(count=4, nvlink=False)
    fake.install(monkeypatch)

    found = detect_gpus()

    assert [g.nvlink_group for g in found.gpus] == [0, 0, 0, 0]
    assert [g.pcie_group for g in found.gpus] == [1, 1, 2, 2]


def test_a_failing_query_reports_no_gpus_rather_than_half_a_node(nvml: FakeNvml) -> None:
    nvml.fail_on = "memory"

    assert detect_gpus() == Detected((), "nvml")
    assert nvml.shutdowns == 1


def test_the_setting_overrides_detection(nvml: FakeNvml) -> None:
    found = node_gpus("A100-80GBx2:81920")

    assert found == Detected((GpuInfo(0, "A100-80GB", 81920), GpuInfo(1, "A100-80GB", 81920)), "setting")
    assert nvml.initialised == 0  # NVML is not even asked
    assert node_gpus("  ").source == "nvml"


def test_no_gpu_machine_reports_none(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_nvml(monkeypatch)
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the no-GPU case needs one without")

    assert detect_gpus() == Detected((), "none")


def test_torch_cuda_is_the_fallback_when_nvml_cannot_load(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_nvml(monkeypatch)
    props = SimpleNamespace(
        name="NVIDIA L4",
        total_memory=23034 * 1024 * 1024,
        uuid="5f2c0d11-1111-2222-3333-444444444444",
        pci_domain_id=0,
        pci_bus_id=0x3B,
        pci_device_id=0,
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)

    found = detect_gpus()

    assert found.source == "torch"
    assert found.gpus == (
        GpuInfo(
            0, "L4", 23034, uuid="GPU-5f2c0d11-1111-2222-3333-444444444444", pci_bus_id="00000000:3B:00.0"
        ),
    )


# --- a detected node against a real scheduler ---------------------------------------------------

TOKEN = "gpu-token"


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[ServiceProcess]:
    env = base_env(
        "scheduler",
        token=TOKEN,
        data_dir=tmp_path / "scheduler",
        grpc_port=free_port(),
        http_port=free_port(),
    )
    process = ServiceProcess("forge_scheduler", env=env, log_path=str(tmp_path / "scheduler.log")).start()
    yield process
    process.stop()


@pytest.mark.integration
async def test_detected_topology_reaches_the_scheduler_and_jobs_see_exactly_their_gpus(
    monkeypatch: pytest.MonkeyPatch, scheduler: ServiceProcess, store: RunStore, tmp_path: Path
) -> None:
    fake = FakeNvml(count=4)
    fake.install(monkeypatch)
    node = NodeInfo(name="gpu-node", gpus=node_gpus("").gpus)
    agent = AgentService(store, LocalProcessRunner(), node, runs_dir=tmp_path / "runs", stop_grace_s=5.0)
    channel = make_channel(scheduler.grpc_target, token=TOKEN)
    session = SchedulerSession(agent, channel, register_timeout_s=5, backoff=Backoff(0.05, 0.3))
    task = asyncio.create_task(session.run())
    release = tmp_path / "release"
    code = (
        "import json, os, pathlib, sys, time\n"
        "out = pathlib.Path(sys.argv[1]) / (os.environ['FORGE_JOB_ID'] + '.json')\n"
        "keys = ('CUDA_VISIBLE_DEVICES', 'CUDA_DEVICE_ORDER')\n"
        "tmp = out.with_suffix('.part')\n"  # written whole, then renamed: the test reads once it exists
        "tmp.write_text(json.dumps({k: os.environ.get(k) for k in keys}))\n"
        "os.replace(tmp, out)\n"
        "while not pathlib.Path(sys.argv[2]).exists(): time.sleep(0.05)\n"
    )
    try:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)

        async def registered() -> scheduler_pb2.Node | None:
            nodes = (await stub.ListNodes(scheduler_pb2.ListNodesRequest())).nodes
            return next(
                (n for n in nodes if n.name == "gpu-node" and n.state == scheduler_pb2.NODE_STATE_READY), None
            )

        listed = await eventually(registered)
        assert [(g.index, g.type, g.memory_mb, g.nvlink_group, g.pcie_group) for g in listed.gpus] == [
            (0, "H100", 81559, 1, 1),
            (1, "H100", 81559, 1, 1),
            (2, "H100", 81559, 1, 2),
            (3, "H100", 81559, 1, 2),
        ]
        assert [g.uuid for g in listed.gpus] == [g.uuid for g in node.gpus] and listed.gpus[0].pci_bus_id

        quota = scheduler_pb2.Quota(gpu_type="H100", guaranteed_gpus=4)
        await stub.CreateTeam(scheduler_pb2.CreateTeamRequest(name="research", quotas=[quota]))
        jobs = []
        for name in ("two-a", "two-b"):
            spec = scheduler_pb2.JobSpec(
                name=name,
                team="research",
                priority_class="normal",
                command=[sys.executable, "-c", code, str(tmp_path), str(release)],
                resources=common_pb2.ResourceRequest(gpu_count=2, gpu_type="H100"),
            )
            jobs.append((await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec))).job.id)

        async def both_reported() -> bool:
            return all((tmp_path / f"{j}.json").exists() for j in jobs)

        try:
            await eventually(both_reported)
        except AssertionError:
            states = [(await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=j))).job for j in jobs]
            raise AssertionError([(j.state, j.message, j.pending_reason) for j in states]) from None
        seen = [json.loads((tmp_path / f"{j}.json").read_text()) for j in jobs]
        devices = [set(s["CUDA_VISIBLE_DEVICES"].split(",")) for s in seen]
        assert all(len(d) == 2 for d in devices) and devices[0].isdisjoint(devices[1])
        assert devices[0] | devices[1] == {"0", "1", "2", "3"}
        assert {s["CUDA_DEVICE_ORDER"] for s in seen} == {"PCI_BUS_ID"}
        assert (await registered()).free_gpus == 0  # the scheduler counts all four as assigned
        release.touch()
    finally:
        release.touch()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await agent.shutdown(grace_s=0)
        await channel.close()


@pytest.mark.integration
async def test_a_two_node_job_rendezvouses_at_the_rank0_agents_advertised_address(
    scheduler: ServiceProcess, tmp_path: Path
) -> None:
    """Two agents (as on two hosts: each advertises its own loopback address) get one gang job of
    two replicas; each replica's MASTER_ADDR is the rank-0 node's advertised address, and the two
    processes meet there and all-reduce over gloo, as NCCL does on GPU nodes."""
    addresses = {"node-a": "127.0.0.2", "node-b": "127.0.0.3"}  # never the default 127.0.0.1
    code = (
        "import datetime, json, os, pathlib, sys\n"
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=60))\n"
        "t = torch.tensor([float(dist.get_rank() + 1)])\n"
        "dist.all_reduce(t)\n"
        "out = pathlib.Path(sys.argv[1]) / f'rank{dist.get_rank()}.json'\n"
        "keys = ('MASTER_ADDR', 'CUDA_VISIBLE_DEVICES', 'WORLD_SIZE')\n"
        "out.write_text(json.dumps({'sum': t.item(), **{k: os.environ[k] for k in keys}}))\n"
        "dist.destroy_process_group()\n"
    )
    agents, sessions, tasks, dbs = [], [], [], []
    channel = make_channel(scheduler.grpc_target, token=TOKEN)
    try:
        for name, address in addresses.items():
            db = Database(f"sqlite+aiosqlite:///{tmp_path / f'{name}.db'}")
            await db.migrate(MIGRATIONS)
            dbs.append(db)
            node = NodeInfo(name=name, gpus=node_gpus("H100x1:81559").gpus, labels={ADDRESS_LABEL: address})
            agent = AgentService(
                RunStore(db), LocalProcessRunner(), node, runs_dir=tmp_path / name, stop_grace_s=5.0
            )
            agents.append(agent)
            session = SchedulerSession(agent, channel, register_timeout_s=5, backoff=Backoff(0.05, 0.3))
            sessions.append(session)
            tasks.append(asyncio.create_task(session.run()))
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)

        async def both_ready() -> bool:
            nodes = (await stub.ListNodes(scheduler_pb2.ListNodesRequest())).nodes
            ready = {n.name for n in nodes if n.state == scheduler_pb2.NODE_STATE_READY}
            return set(addresses) <= ready

        await eventually(both_ready)
        quota = scheduler_pb2.Quota(gpu_type="H100", guaranteed_gpus=2)
        await stub.CreateTeam(scheduler_pb2.CreateTeamRequest(name="research", quotas=[quota]))
        spec = scheduler_pb2.JobSpec(
            name="ddp",
            team="research",
            priority_class="normal",
            command=[sys.executable, "-c", code, str(tmp_path)],
            resources=common_pb2.ResourceRequest(gpu_count=1, gpu_type="H100"),
            replicas=2,
        )
        job_id = (await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec))).job.id

        async def finished() -> scheduler_pb2.Job | None:
            job = (await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id))).job
            return job if job.state in (common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED) else None

        job = await eventually(finished, timeout_s=120)
        assert job.state == common_pb2.JOB_STATE_SUCCEEDED, job.message
        rank0 = job.assigned_nodes[0]
        nodes = {n.node_id: n.name for n in (await stub.ListNodes(scheduler_pb2.ListNodesRequest())).nodes}
        master = addresses[nodes.get(rank0, rank0)]
        seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
        assert (
            seen == [{"sum": 3.0, "MASTER_ADDR": master, "CUDA_VISIBLE_DEVICES": "0", "WORLD_SIZE": "2"}] * 2
        )
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for agent in agents:
            await agent.shutdown(grace_s=0)
        await channel.close()
        for db in dbs:
            await db.dispose()
