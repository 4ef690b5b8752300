"""Model servers eval starts for a run: a subprocess serving one registered checkpoint folder for
the duration of one run (RunSuite's ``serve_model``), Forge's ``forge_model_server``
(:class:`LocalModelServer`) or vLLM's OpenAI-compatible server (:class:`VllmModelServer`).

Why here and not in the workflow: the server must live exactly as long as the run that queries
it, and the run executes in this process. It is started after the run is claimed, health-checked
(ready file, ``/readyz``, the model listed by ``/v1/models``) and stopped in a ``finally`` — on
success, failure or cancellation — and it dies with this process too (``PR_SET_PDEATHSIG``, set by
:mod:`forge_eval.spawn` in the child, never by Python code between fork and exec), so no server
outlives its run. Each server gets a fresh random bearer token that only this run knows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from forge_eval import spawn
from forge_kit.ports import free_port
from forge_kit.vllm import LaunchError, NotReady, VllmLaunch, wait_ready

#: The file the model server reads a model's version from (its folder name is the model's name).
VERSION_FILE = "forge_model.json"


class ModelServerError(Exception):
    """The model server could not be started or did not become healthy; the message says why."""


@dataclass(frozen=True)
class ServedModel:
    """A running model server: where it listens, the token it accepts, the model id it lists (the
    model's name; ``name:version`` also resolves)."""

    endpoint: str
    token: str
    model: str


class ModelHost(Protocol):
    """Starts a model server for one checkpoint folder.

    Called by :meth:`forge_eval.runs.RunService.execute_run` for a run with ``serve_model``;
    the server is up when the context is entered and stopped when it exits, however it exits.
    """

    def serve(self, name: str, version: str, checkpoint: Path) -> AbstractAsyncContextManager[ServedModel]:
        """Serve ``checkpoint`` as ``name:version``; raises :class:`ModelServerError`."""


def local_checkpoint(uri: str) -> Path | None:
    """The local Hugging Face checkpoint folder ``uri`` names (a path or ``file://`` URL with a
    ``config.json``), or None."""
    path = Path(uri.removeprefix("file://")).expanduser()
    return path.resolve() if path.is_absolute() and (path / "config.json").is_file() else None


class LocalModelServer:
    """:class:`ModelHost` that runs ``command`` (``python -m forge_model_server``) as a subprocess.

    1. lay out a model directory holding one folder named after the model: links to the
       checkpoint's files plus ``forge_model.json`` with the version (the checkpoint is not touched);
    2. start the server on free ports (port 0; it reports them in its ready file) with a random token;
    3. wait for its ready file, ``/readyz`` and the model in ``/v1/models``;
    4. on exit, SIGTERM, then SIGKILL after ``stop_timeout_s``; remove the directory.
    """

    def __init__(
        self,
        command: Sequence[str] = (),
        work_dir: Path | None = None,
        *,
        start_timeout_s: float = 120.0,
        stop_timeout_s: float = 10.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self._command = list(command) or [sys.executable, "-m", "forge_model_server"]
        self._work_dir = work_dir
        self._start_timeout_s = start_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._env = dict(env or {})

    @asynccontextmanager
    async def serve(self, name: str, version: str, checkpoint: Path) -> AsyncIterator[ServedModel]:
        root = _scratch(self._work_dir, f"serve-{name}-")
        process: asyncio.subprocess.Process | None = None
        try:
            models = _lay_out(root, name, version, checkpoint)
            token = secrets.token_urlsafe(24)
            process = await self._spawn(root, models, token)
            served = await self._wait_healthy(process, root, token, name)
            yield served
        finally:
            if process is not None:
                await _stop(process, self._stop_timeout_s)
            shutil.rmtree(root, ignore_errors=True)

    async def _spawn(self, root: Path, models: Path, token: str) -> asyncio.subprocess.Process:
        inherited = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("FORGE_MODEL_SERVER_") and k != "FORGE_READY_FILE"
        }
        env = {
            **inherited,
            "FORGE_MODEL_SERVER_MODELS_DIR": str(models),
            "FORGE_MODEL_SERVER_HTTP_PORT": "0",
            "FORGE_MODEL_SERVER_GRPC_PORT": "0",
            "FORGE_MODEL_SERVER_AUTH_TOKEN": token,
            "FORGE_MODEL_SERVER_DATA_DIR": str(root / "data"),
            "FORGE_MODEL_SERVER_KAFKA_ENABLED": "false",
            "FORGE_READY_FILE": str(root / "ready.json"),
            **self._env,
        }
        return await _start(self._command, env, root)

    async def _wait_healthy(
        self, process: asyncio.subprocess.Process, root: Path, token: str, model: str
    ) -> ServedModel:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._start_timeout_s
        ready = root / "ready.json"
        endpoint = ""
        async with httpx.AsyncClient(timeout=5.0, headers={"Authorization": f"Bearer {token}"}) as client:
            while loop.time() < deadline:
                if process.returncode is not None:
                    raise ModelServerError(
                        f"the model server exited with {process.returncode} during start-up: {_tail(root)}"
                    )
                if not endpoint and ready.is_file():
                    with contextlib.suppress(ValueError):
                        endpoint = f"http://127.0.0.1:{int(json.loads(ready.read_text())['http_port'])}"
                if endpoint and await _healthy(client, endpoint, model):
                    return ServedModel(endpoint=endpoint, token=token, model=model)
                await asyncio.sleep(0.1)
        raise ModelServerError(
            f"the model server did not serve {model} within {self._start_timeout_s:g}s: {_tail(root)}"
        )


class VllmModelServer:
    """:class:`ModelHost` that runs vLLM's OpenAI-compatible server (:mod:`forge_kit.vllm`, from
    vLLM's own environment) on the checkpoint folder itself, as ``name`` and ``name:version``.

    1. start it on a free port with a random key (in its environment, never in argv) and the
       operator's engine arguments;
    2. wait until ``/health`` answers and ``/v1/models`` lists the model (a minute or more on CPUs);
    3. on exit, SIGTERM, then SIGKILL after ``stop_timeout_s``.

    The checkpoint must have a shape vLLM serves (on CPUs a head size of 64, not 16); a LLaVA
    export needs ``model_impl: transformers`` among the engine arguments on a CPU build.
    """

    def __init__(
        self,
        python: str = "",
        work_dir: Path | None = None,
        *,
        engine_args: Mapping[str, str | int | float | bool] | None = None,
        kv_cache_gib: int = 1,
        threads: int = 0,
        start_timeout_s: float = 300.0,
        stop_timeout_s: float = 10.0,
    ) -> None:
        self._python = python
        self._work_dir = work_dir
        self._engine_args = dict(engine_args or {})
        self._kv_cache_gib = kv_cache_gib
        self._threads = threads
        self._start_timeout_s = start_timeout_s
        self._stop_timeout_s = stop_timeout_s

    @asynccontextmanager
    async def serve(self, name: str, version: str, checkpoint: Path) -> AsyncIterator[ServedModel]:
        root = _scratch(self._work_dir, f"vllm-{name}-")
        process: asyncio.subprocess.Process | None = None
        try:
            token = secrets.token_urlsafe(24)
            try:
                launch = VllmLaunch(
                    checkpoint,
                    free_port("127.0.0.1"),
                    name,
                    engine_args=self._engine_args,
                    api_key=token,
                    kv_cache_gib=self._kv_cache_gib,
                    threads=self._threads,
                    python=self._python,
                    also_served_as=(f"{name}:{version}",),
                )
                argv = launch.argv()
            except (LaunchError, FileNotFoundError) as exc:
                raise ModelServerError(f"cannot serve {name}:{version} on vLLM: {exc}") from exc
            if shutil.which(argv[0]) is None:
                raise ModelServerError(f"cannot serve {name}:{version} on vLLM: no interpreter {argv[0]}")
            process = await _start(argv, launch.env(), root)
            running = process
            try:
                await asyncio.to_thread(
                    wait_ready, launch, self._start_timeout_s, alive=lambda: running.returncode is None
                )
            except NotReady as exc:
                raise ModelServerError(f"{exc}: {_tail(root)}") from exc
            yield ServedModel(endpoint=launch.url, token=token, model=name)
        finally:
            if process is not None:
                await _stop(process, self._stop_timeout_s)
            shutil.rmtree(root, ignore_errors=True)


def _scratch(work_dir: Path | None, prefix: str) -> Path:
    """A new folder for one served run (its log, its model layout), under ``work_dir`` when set."""
    if work_dir is not None:
        work_dir.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=work_dir))


async def _start(argv: Sequence[str], env: Mapping[str, str], root: Path) -> asyncio.subprocess.Process:
    """``argv`` as a child that dies with this process, its output in ``root/server.log``."""
    log = (root / "server.log").open("wb")
    try:
        return await asyncio.create_subprocess_exec(
            *spawn.command(argv, die_with_parent=True),
            env=dict(env),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
        )
    except OSError as exc:
        raise ModelServerError(f"cannot start the model server {list(argv)}: {exc}") from exc
    finally:
        log.close()


async def _stop(process: asyncio.subprocess.Process, timeout_s: float) -> None:
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(process.wait()), timeout=timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
    await process.wait()


def _lay_out(root: Path, name: str, version: str, checkpoint: Path) -> Path:
    folder = root / "models" / name
    folder.mkdir(parents=True)
    for item in checkpoint.iterdir():
        if item.name != VERSION_FILE:
            (folder / item.name).symlink_to(item.resolve())
    (folder / VERSION_FILE).write_text(json.dumps({"version": version}))
    return root / "models"


async def _healthy(client: httpx.AsyncClient, endpoint: str, model: str) -> bool:
    try:
        ready = await client.get(f"{endpoint}/readyz")
        if ready.status_code != 200:
            return False
        listed = await client.get(f"{endpoint}/v1/models")
        return listed.status_code == 200 and any(c.get("id") == model for c in listed.json().get("data", []))
    except (httpx.HTTPError, ValueError):
        return False


def _tail(root: Path, chars: int = 1500) -> str:
    try:
        return (root / "server.log").read_text(errors="replace")[-chars:].strip() or "(no output)"
    except OSError:
        return "(no log)"
