"""Gradient all-reduce through shared memory, for data-parallel ranks on one CPU host.

Under gloo, DDP's all-reduce of the gradients goes over TCP on loopback, several times slower
than copying them into shared memory and summing the ranks' copies (``load/training/RESULTS.md``).
On one host every rank can read every other rank's gradients in place, as DeepSpeed's and oneCCL's
CPU back ends do; NCCL does the same on a GPU node, so this is the CPU path only.

The segment is a file in ``/dev/shm``, mapped by every rank and unlinked once all have it (so a
crash leaves nothing behind): two banks of one slot per rank, and one flag per rank on its own
cache line. An all-reduce goes through the tensor in chunks of one slot:

1. copy this rank's chunk into its slot of the bank for this call (banks alternate);
2. publish the call's number in this rank's flag, then wait until every rank's flag has it;
3. sum the bank's slots in rank order into the chunk (every rank computes the same sum, bit for
   bit).

A rank cannot overwrite a bank before every rank has left it: to publish call ``n + 2`` it must
first have seen every rank reach call ``n + 1``, which each rank does only after summing call
``n``. Step 2 relies on stores becoming visible in program order, which x86-64 guarantees;
elsewhere, and when the ranks do not share ``/dev/shm`` (another host, another container),
:meth:`SharedMemoryAllReduce.create` returns ``None`` and DDP keeps the backend's all-reduce.
"""

# No ``from __future__ import annotations`` here: DDP checks a hook's annotations against
# ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` as objects, not strings.
import os
import platform
import secrets
import tempfile
import time
from pathlib import Path

import structlog
import torch
import torch.distributed as dist

log = structlog.get_logger(__name__)

SHM_DIR = Path("/dev/shm")
SLOT_BYTES = 4 << 20
"""Bytes of one rank's slot: a 2-rank group maps 16 MiB plus flags, inside Docker's default
64 MiB ``/dev/shm``."""
_FLAG_STRIDE = 8  # int64s per flag: one 64-byte cache line each
_HEADER_BYTES = 64  # the token other ranks check before trusting the mapping
_SPINS = 200  # flag reads (a few microseconds each) before giving the core away
_YIELD_S = 0.002  # then sched_yield for this long (the peer may share this core)
_NAP_S = 0.0002  # then sleep: a rank waiting on a slow peer must not take its CPU time


class SharedMemoryAllReduce:
    """Sum tensors over the ranks of the default process group through one shared mapping."""

    def __init__(
        self, mapping: torch.Tensor, rank: int, world_size: int, timeout_s: float, path: str = ""
    ) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.path = path  # unlinked once every rank has mapped it
        flags_bytes = world_size * _FLAG_STRIDE * 8
        start = _HEADER_BYTES
        self._flags = mapping[start : start + flags_bytes].view(torch.int64)[::_FLAG_STRIDE]
        start += flags_bytes
        self._banks = mapping[start : start + 2 * world_size * SLOT_BYTES].view(2, world_size, SLOT_BYTES)
        self._mapping = mapping  # keeps the views' storage alive
        self._calls = 0

    @staticmethod
    def supported() -> bool:
        """Whether this host could share a segment at all (``/dev/shm``, x86-64 ordering)."""
        return SHM_DIR.is_dir() and platform.machine().lower() in ("x86_64", "amd64")

    @classmethod
    def create(cls, device: torch.device, timeout_s: float = 1800.0) -> "SharedMemoryAllReduce | None":
        """Collective over the default group: the shared all-reduce when every rank maps the same
        segment (same host, shared ``/dev/shm``, x86-64), else ``None``. Every rank must call it.
        ``None`` at once, with no collective, for one process (no group), a backend other than gloo
        or tensors on ``device`` other than the CPU: every rank sees the same."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        if dist.get_backend() != "gloo" or device.type != "cpu":
            return None
        rank, world_size = dist.get_rank(), dist.get_world_size()
        size = segment_bytes(world_size)
        offer: list[tuple[str, bytes] | None] = [None]
        if rank == 0 and cls.supported():
            offer = [_create_segment(size)]
        dist.broadcast_object_list(offer, src=0)
        segment = offer[0]
        mapping = _map_segment(segment, size) if segment is not None else None
        mapped = torch.tensor([1 if mapping is not None else 0], dtype=torch.int32)
        dist.all_reduce(mapped, op=dist.ReduceOp.MIN)  # the backend's own, before the segment is trusted
        if rank == 0 and segment is not None:
            Path(segment[0]).unlink(missing_ok=True)  # every rank has mapped it (or given up)
        if segment is None or mapping is None or not int(mapped.item()):
            log.info("allreduce.shared_memory_unavailable", world_size=world_size)
            return None
        path = segment[0]
        log.info("allreduce.shared_memory", world_size=world_size, slot_bytes=SLOT_BYTES, path=path)
        return cls(mapping, rank, world_size, timeout_s, path)

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` (contiguous, on the CPU) over the ranks, in place; returns it."""
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError("shared-memory all-reduce: a contiguous CPU tensor is needed")
        flat = tensor.view(-1)
        per_slot = SLOT_BYTES // tensor.element_size()
        for start in range(0, flat.numel(), per_slot):
            chunk = flat[start : start + per_slot]
            n = chunk.numel()
            self._calls += 1
            bank = self._banks[self._calls % 2].view(tensor.dtype)[:, :n]
            bank[self.rank].copy_(chunk)  # 1.
            self._flags[self.rank] = self._calls  # 2.
            self._wait_for(self._calls)
            torch.sum(bank, dim=0, out=chunk)  # 3.
        return tensor

    def _wait_for(self, call: int) -> None:
        """Until every rank has published ``call``: spin, then yield, then nap."""
        spins, started = 0, 0.0
        while int(self._flags.min()) < call:
            spins += 1
            if spins < _SPINS:
                continue
            now = time.monotonic()
            if not started:
                started = now
            if now - started < _YIELD_S:
                os.sched_yield()
                continue
            time.sleep(_NAP_S)
            if now - started > self.timeout_s:
                late = [r for r, c in enumerate(self._flags.tolist()) if c < call]
                raise TimeoutError(
                    f"shared-memory all-reduce: rank(s) {late} did not reach call {call} "
                    f"within {self.timeout_s:g} s"
                )

    def ddp_hook(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """A DDP communication hook averaging the bucket over the ranks, as DDP's default
        (divide by the world size, then sum): ``ddp.register_comm_hook(None, self.ddp_hook)``."""
        buffer = bucket.buffer()
        buffer.div_(self.world_size)
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(self.all_reduce_(buffer))
        return done


def segment_bytes(world_size: int) -> int:
    """Bytes of a group's segment: the header, one flag line per rank, two banks of slots."""
    return _HEADER_BYTES + world_size * _FLAG_STRIDE * 8 + 2 * world_size * SLOT_BYTES


def _create_segment(size: int) -> tuple[str, bytes] | None:
    """A ``size``-byte file in /dev/shm with its space reserved (so a full tmpfs fails here, not
    as a SIGBUS on first touch) and a random token in its header; None when that fails."""
    token = secrets.token_bytes(16)
    try:
        fd, path = tempfile.mkstemp(prefix="forge-allreduce-", dir=SHM_DIR)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, size)
        os.pwrite(fd, token, 0)
    except OSError as e:
        log.warning("allreduce.shared_memory_segment_failed", path=path, error=str(e))
        os.close(fd)
        Path(path).unlink(missing_ok=True)
        return None
    os.close(fd)
    return path, token


def _map_segment(offer: tuple[str, bytes], size: int) -> torch.Tensor | None:
    """The segment as a byte tensor when this rank sees the same file (same token), else None."""
    path, token = offer
    try:
        with open(path, "rb") as f:
            if f.read(len(token)) != token:
                return None
        return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    except (OSError, RuntimeError):
        return None
