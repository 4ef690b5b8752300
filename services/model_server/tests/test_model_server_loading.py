"""Loading a model's engine: off the event loop, once per model, or at start-up (``preload``)."""

from __future__ import annotations

import asyncio
import shutil
import threading
from pathlib import Path

import pytest

from forge_kit import errors
from forge_kit.objectstore import ObjectStore
from forge_model_server.service import Engine, ModelDirectory, ModelInfo, ModelServer

pytestmark = pytest.mark.asyncio


class SlowLoader:
    """Holds each load until released, counting loads per model and the thread they ran on."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.loads: list[tuple[str, str]] = []

    def __call__(self, model: ModelInfo) -> Engine:
        self.loads.append((model.name, threading.current_thread().name))
        assert self.release.wait(30), "the test never released the load"
        return object()  # type: ignore[return-value]  # the engine is not used


@pytest.fixture
def models(tmp_path: Path, tiny_llama: Path) -> Path:
    shutil.copytree(tiny_llama, tmp_path / "models" / "tiny")
    return tmp_path / "models"


async def test_a_first_load_leaves_the_event_loop_free_and_runs_once(models: Path) -> None:
    loader = SlowLoader()
    server = ModelServer(ModelDirectory(ObjectStore(str(models))), loader=loader)
    loads = [asyncio.create_task(server.load("tiny")) for _ in range(3)]
    ticks = 0
    while not loader.loads or ticks < 5:  # the loop keeps running while the load is held
        await asyncio.sleep(0.01)
        ticks += 1
    assert not any(task.done() for task in loads)
    loader.release.set()
    engines = {id(engine) for _, engine in await asyncio.gather(*loads)}
    assert len(engines) == 1 and len(loader.loads) == 1
    assert loader.loads[0][1] != threading.main_thread().name
    assert server.is_loaded(server.lookup("tiny"))


async def test_preload_loads_before_the_first_request_and_names_an_unknown_model(models: Path) -> None:
    loader = SlowLoader()
    loader.release.set()
    server = ModelServer(ModelDirectory(ObjectStore(str(models))), loader=loader)
    await server.preload(["tiny"])
    assert [name for name, _ in loader.loads] == ["tiny"]
    with pytest.raises(errors.NotFoundError, match="missing"):
        await server.preload(["missing"])
