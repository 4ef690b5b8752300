"""Checkpoints: per-rank shards in the object store, published by an atomic manifest.

Layout under ``checkpoints/<run_id>/step-<step>/``: ``rank-<r>.pt`` (each rank's RNG state;
rank 0's also holds model, optimizer, scheduler and sampler position), ``rank-<r>.part.json``
(the shard's sha256 and size, the hand-off to rank 0) and ``manifest.json``, written last by rank
0 once every part record is there. A step directory without a readable manifest whose checksums
all match is not a checkpoint: :meth:`CheckpointManager.load_latest` skips it (and logs why) in
favour of the previous complete one.

Saving stalls the training loop only for the in-memory copy of the state; serialisation, upload
and publication run in one background thread (one save in flight at a time). GPU tensors are
copied into page-locked host buffers on a side CUDA stream (ordered after the work already queued
on the training stream), so the stall is the device-to-host copy alone; the buffers are kept and
reused by the next save (its copy waits for the previous write, which reads them).

How often to save: a fixed step count, or the Young/Daly optimum from the job's mean time between
failures and the measured save time (:func:`optimal_interval_s`).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from forge_kit import errors
from forge_kit.objectstore import ObjectStore

log = structlog.get_logger(__name__)

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def optimal_interval_s(policy: str, save_s: float, mtbf_s: float) -> float:
    """Seconds of training between checkpoints that minimise expected lost work plus save time.

    ``young`` (Young 1974): ``sqrt(2 d M)`` for save time ``d`` and mean time between failures
    ``M``. ``daly`` (Daly 2006, the higher-order estimate): ``sqrt(2 d M) [1 + (d/2M)^(1/2) / 3
    + (d/2M) / 9] - d`` while ``d < 2M``, else ``M``.
    """
    if save_s < 0 or mtbf_s <= 0:
        raise ValueError(f"need save_s >= 0 and mtbf_s > 0, got {save_s}, {mtbf_s}")
    young = math.sqrt(2.0 * save_s * mtbf_s)
    if policy == "young":
        return young
    if policy == "daly":
        if save_s >= 2.0 * mtbf_s:
            return mtbf_s
        ratio = save_s / (2.0 * mtbf_s)
        return young * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - save_s
    raise ValueError(f"unknown checkpoint interval policy {policy!r}")


class CheckpointError(Exception):
    """A checkpoint that cannot be used (torn, corrupt, or for another run shape)."""


class _HostBuffers:
    """Page-locked host tensors for GPU state, reused save after save in traversal order (the
    state's structure is the same every save; a tensor whose shape or dtype changed gets a new one)."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._next = 0

    def rewind(self) -> None:
        self._next = 0

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        i, self._next = self._next, self._next + 1
        if i < len(self._buffers) and self._buffers[i].shape == t.shape and self._buffers[i].dtype == t.dtype:
            host = self._buffers[i]
        else:
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            self._buffers[i : i + 1] = [host]
        host.copy_(t, non_blocking=True)
        return host


def _snapshot(obj: Any, host: _HostBuffers | None = None) -> Any:
    """A deep copy whose tensors are detached CPU clones, so training may go on mutating; GPU
    tensors go to ``host``'s pinned buffers (asynchronously: synchronise the stream before use)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.is_cuda and host is not None:
            return host.copy(t)
        return t.to("cpu", copy=True)
    if isinstance(obj, Mapping):
        return {k: _snapshot(v, host) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_snapshot(v, host) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_snapshot(v, host) for v in obj)
    return obj


def _on_gpu(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.is_cuda
    if isinstance(obj, Mapping):
        return any(_on_gpu(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(_on_gpu(v) for v in obj)
    return False


@dataclass
class Manifest:
    """What a published checkpoint holds; ``files`` maps object key to sha256 and size."""

    run_id: str
    step: int
    world_size: int
    files: dict[str, dict[str, Any]]
    meta: dict[str, Any] = field(default_factory=dict)
    key: str = ""

    def to_json(self) -> bytes:
        body = {
            "run_id": self.run_id,
            "step": self.step,
            "world_size": self.world_size,
            "files": self.files,
            "meta": self.meta,
        }
        return json.dumps(body, indent=1, sort_keys=True).encode()


@dataclass
class SaveStats:
    """Seconds the training loop was blocked per save (the figure async saving must keep small)."""

    stalls_s: list[float] = field(default_factory=list)
    writes_s: list[float] = field(default_factory=list)


class CheckpointManager:
    """Saves and finds this run's checkpoints; one instance per rank."""

    def __init__(
        self,
        store: ObjectStore,
        run_id: str,
        *,
        rank: int = 0,
        world_size: int = 1,
        keep_last: int = 3,
        async_save: bool = True,
        part_timeout_s: float = 600.0,
        on_published: Callable[[Manifest], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.store = store
        self.prefix = f"checkpoints/{run_id}"
        self.run_id, self.rank, self.world_size = run_id, rank, world_size
        self.keep_last, self.async_save = keep_last, async_save
        self.part_timeout_s = part_timeout_s
        self.on_published = on_published
        self.clock = clock
        self.stats = SaveStats()
        self.last_published: Manifest | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._host = _HostBuffers()
        self._stream: torch.cuda.Stream | None = None

    def step_dir(self, step: int) -> str:
        return f"{self.prefix}/step-{step:08d}"

    # -- saving ---------------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> None:
        """Snapshot ``state`` now and write it (in the background when ``async_save``)."""
        started = self.clock()
        self.wait()
        snapshot = self._copy(state)
        meta_copy = dict(meta or {})
        if self.async_save:
            self._thread = threading.Thread(
                target=self._write_guarded, args=(step, snapshot, meta_copy), daemon=True
            )
            self._thread.start()
        else:
            self._write(step, snapshot, meta_copy)
        self.stats.stalls_s.append(self.clock() - started)

    def _copy(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """:func:`_snapshot` of ``state``; its GPU tensors copied on the side stream into the
        reused pinned buffers, waited for before returning (the stall is that copy)."""
        if not _on_gpu(state):
            return dict(_snapshot(state))
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        self._host.rewind()
        with torch.cuda.stream(self._stream):
            snapshot = _snapshot(state, self._host)
        self._stream.synchronize()
        return dict(snapshot)

    def wait(self) -> None:
        """Block until the save in flight (if any) is published; re-raise its failure."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"background checkpoint save failed: {error!r}") from error

    def _write_guarded(self, step: int, snapshot: dict[str, Any], meta: dict[str, Any]) -> None:
        try:
            self._write(step, snapshot, meta)
        except BaseException as exc:  # noqa: BLE001 - surfaced by wait() on the training thread
            self._error = exc

    def _write(self, step: int, snapshot: dict[str, Any], meta: dict[str, Any]) -> None:
        """:meth:`_upload`; a failure names the step and the newest checkpoint left to resume."""
        try:
            self._upload(step, snapshot, meta)
        except CheckpointError:
            raise
        except Exception as exc:
            what = "storage is full" if errors.storage_full(exc) else type(exc).__name__
            kept = self.last_published  # rank 0 publishes, so only rank 0 knows it
            newest = (
                f"; the newest complete checkpoint is step {kept.step}" if kept and self.rank == 0 else ""
            )
            raise CheckpointError(f"checkpoint of step {step} not written ({what}: {exc}){newest}") from exc

    def _upload(self, step: int, snapshot: dict[str, Any], meta: dict[str, Any]) -> None:
        """1. serialise; 2. upload the shard, then its part record; 3. rank 0 publishes."""
        started = self.clock()
        # 1. Serialise.
        buf = io.BytesIO()
        torch.save(snapshot, buf)
        data = buf.getvalue()
        # 2. Upload.
        base = self.step_dir(step)
        shard_key = f"{base}/rank-{self.rank:05d}.pt"
        self.store.put_bytes(shard_key, data)
        part = {"key": shard_key, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        self.store.put_bytes(f"{base}/rank-{self.rank:05d}.part.json", json.dumps(part).encode())
        # 3. Publish.
        if self.rank == 0:
            self._publish(step, meta)
        self.stats.writes_s.append(self.clock() - started)

    def _publish(self, step: int, meta: dict[str, Any]) -> None:
        base = self.step_dir(step)
        deadline = time.monotonic() + self.part_timeout_s
        files: dict[str, dict[str, Any]] = {}
        for r in range(self.world_size):
            part_key = f"{base}/rank-{r:05d}.part.json"
            while not self.store.exists(part_key):
                if time.monotonic() > deadline:
                    raise CheckpointError(f"rank {r} did not write its shard of step {step}")
                time.sleep(0.01)
            part = json.loads(self.store.get_bytes(part_key))
            files[part["key"]] = {"sha256": part["sha256"], "size": part["size"]}
        if self.last_published is not None:
            meta.setdefault("parent", self.last_published.key)
        manifest = Manifest(self.run_id, step, self.world_size, files, meta, key=f"{base}/{MANIFEST}")
        self.store.put_bytes(manifest.key, manifest.to_json())
        self.last_published = manifest
        log.info("checkpoint.published", key=manifest.key, step=step)
        self._retain()
        if self.on_published is not None:
            self.on_published(manifest)

    def _retain(self) -> None:
        """Keep the newest ``keep_last`` complete checkpoints; drop everything older."""
        complete = [s for s in self._steps() if self.store.exists(f"{self.step_dir(s)}/{MANIFEST}")]
        if len(complete) <= self.keep_last:
            return
        oldest_kept = complete[-self.keep_last]
        for step in self._steps():
            if step < oldest_kept:
                self.store.delete(self.step_dir(step), recursive=True)

    # -- loading --------------------------------------------------------------------------------

    def _steps(self) -> list[int]:
        steps = set()
        for key in self.store.list(self.prefix):
            parts = key[len(self.prefix) + 1 :].split("/")
            match = _STEP_DIR.match(parts[0])
            if match:
                steps.add(int(match.group(1)))
        return sorted(steps)

    def read_manifest(self, step: int) -> Manifest:
        """The manifest of ``step`` after checking every file's size and sha256."""
        key = f"{self.step_dir(step)}/{MANIFEST}"
        if not self.store.exists(key):
            raise CheckpointError(f"{key}: no manifest (torn or in progress)")
        try:
            body = json.loads(self.store.get_bytes(key))
            manifest = Manifest(
                body["run_id"],
                int(body["step"]),
                int(body["world_size"]),
                dict(body["files"]),
                dict(body["meta"]),
                key=key,
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{key}: unreadable manifest ({exc})") from None
        for file_key, expect in manifest.files.items():
            if not self.store.exists(file_key):
                raise CheckpointError(f"{file_key}: listed in the manifest but missing")
            digest = hashlib.sha256(self.store.get_bytes(file_key)).hexdigest()
            if digest != expect["sha256"]:
                raise CheckpointError(f"{file_key}: checksum mismatch")
        return manifest

    def latest_manifest(self) -> Manifest | None:
        """The newest complete checkpoint; torn or corrupt ones are logged and skipped."""
        for step in reversed(self._steps()):
            try:
                return self.read_manifest(step)
            except CheckpointError as exc:
                log.warning("checkpoint.skipped", step=step, reason=str(exc))
        return None

    def load_shard(self, manifest: Manifest, rank: int) -> dict[str, Any]:
        key = f"{self.step_dir(manifest.step)}/rank-{rank:05d}.pt"
        if key not in manifest.files:
            raise CheckpointError(f"{key}: not part of {manifest.key}")
        loaded: dict[str, Any] = torch.load(io.BytesIO(self.store.get_bytes(key)), weights_only=True)
        return loaded
