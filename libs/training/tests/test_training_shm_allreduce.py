"""The shared-memory all-reduce of CPU ranks on one host: it sums like gloo (bit for bit on two
ranks, in rank order on more), across several slots; as DDP's communication hook it leaves the
same gradients as gloo's all-reduce; a rank that never arrives is named in a timeout; and where
the ranks cannot share a segment, the group keeps the backend's all-reduce."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from forge_kit.testing.processes import free_port
from forge_training import shm_allreduce
from forge_training.shm_allreduce import SLOT_BYTES, SharedMemoryAllReduce, segment_bytes

pytestmark = pytest.mark.skipif(not SharedMemoryAllReduce.supported(), reason="needs /dev/shm on x86-64")


def _in_one_group(rank: int, world_size: int, port: int, scenarios: list[tuple[str, int]]) -> None:
    """Each ``(name, arg)`` of ``scenarios`` in turn on one gloo group: the ranks import torch and
    join a group once (a spawned rank's start-up is most of these tests' time), not per scenario."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        for name, arg in scenarios:
            {"sums": _sums_like_gloo, "falls_back": _falls_back}[name](rank, world_size, arg)
    finally:
        dist.destroy_process_group()


def _sums_like_gloo(rank: int, world_size: int, _: int) -> None:
    shared = SharedMemoryAllReduce.create(torch.device("cpu"))
    assert shared is not None
    dist.barrier()  # rank 0 unlinks it once every rank has mapped it: a crash leaks nothing
    assert not Path(shared.path).exists()
    generator = torch.Generator().manual_seed(rank)
    # Two slots and a bit in float32 (three rounds through the banks), a few floats in float64.
    for numel, dtype in ((2 * SLOT_BYTES // 4 + 1234, torch.float32), (7, torch.float64)):
        mine = torch.randn(numel, generator=generator, dtype=dtype)
        expected = mine.clone()
        dist.all_reduce(expected)
        got = shared.all_reduce_(mine.clone())
        if world_size == 2:
            assert torch.equal(got, expected)
        else:  # gloo's ring adds in another order
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        parts = [torch.empty_like(got) for _ in range(world_size)]
        dist.all_gather(parts, got)
        assert all(torch.equal(p, got) for p in parts)  # every rank holds the same sum

    # As DDP's hook: three steps give the gradients and weights of gloo's all-reduce.
    def train(hooked: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 3))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        if hooked:
            ddp.register_comm_hook(None, shared.ddp_hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        data = torch.Generator().manual_seed(100 + rank)
        for _ in range(3):
            optimizer.zero_grad()
            ddp(torch.randn(8, 64, generator=data)).square().mean().backward()
            optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    hooked, plain = train(True), train(False)
    for a, b in zip(hooked, plain, strict=True):
        if world_size == 2:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b)


def _falls_back(rank: int, world_size: int, missing_on: int) -> None:
    shm_dir, map_segment = shm_allreduce.SHM_DIR, shm_allreduce._map_segment
    try:
        if rank == missing_on == 0:  # rank 0 has no /dev/shm to offer a segment in
            shm_allreduce.SHM_DIR = Path("/nonexistent-shm")
        elif rank == missing_on:  # this rank does not see rank 0's segment (another host or container)
            shm_allreduce._map_segment = lambda offer, size: None
        assert SharedMemoryAllReduce.create(torch.device("cpu")) is None
    finally:
        shm_allreduce.SHM_DIR, shm_allreduce._map_segment = shm_dir, map_segment


def test_two_ranks_sum_like_gloo_and_keep_the_backends_all_reduce_where_they_cannot_share_a_segment() -> None:
    """On one 2-rank group: the sums and DDP's hook match gloo bit for bit; then rank 0 has no
    /dev/shm to offer a segment in, then rank 1 does not see rank 0's segment (another host or
    container): every rank gets ``None`` and keeps the backend's all-reduce."""
    scenarios = [("sums", 0), ("falls_back", 0), ("falls_back", 1)]
    mp.spawn(_in_one_group, args=(2, free_port(), scenarios), nprocs=2)


def test_three_ranks_sum_and_average_gradients_like_gloo() -> None:
    mp.spawn(_in_one_group, args=(3, free_port(), [("sums", 0)]), nprocs=3)


def test_a_segment_of_another_host_is_not_trusted(tmp_path: Path) -> None:
    path = tmp_path / "segment"
    path.write_bytes(b"another token".ljust(64, b"\0"))
    assert shm_allreduce._map_segment((str(path), b"this run's token"), 64) is None
    assert shm_allreduce._map_segment((str(tmp_path / "absent"), b"x"), 64) is None


def test_a_rank_that_never_arrives_is_named_in_a_timeout() -> None:
    mapping = torch.zeros(segment_bytes(2), dtype=torch.uint8)  # rank 1 never writes its flag
    shared = SharedMemoryAllReduce(mapping, rank=0, world_size=2, timeout_s=0.2)
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] did not reach call 1 within 0.2 s"):
        shared.all_reduce_(torch.ones(4))
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        shared.all_reduce_(torch.ones(4, 2).t())
