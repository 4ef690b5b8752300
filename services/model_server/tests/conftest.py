from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest

from forge_kit.http import make_app
from forge_kit.objectstore import ObjectStore
from forge_model_server.openai_api import install_openai_api
from forge_model_server.service import (
    Engine,
    GenerationChunk,
    GenerationRequest,
    ModelDirectory,
    ModelInfo,
    ModelServer,
)

TOKEN = "test-token"


def _make_model(
    root: Path, name: str, *, version: str | None = None, weights: bool = False, context: int = 256
) -> Path:
    """A Hugging Face-format model folder with a minimal Llama config."""
    folder = root / name
    folder.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "max_position_embeddings": context,
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer_config.json").write_text("{}")
    if version is not None:
        (folder / "forge_model.json").write_text(json.dumps({"version": version}))
    if weights:
        (folder / "model.safetensors").write_bytes(b"\x00" * 8)
    return folder


class ScriptedEngine:
    """Engine-seam test double: replays fixed text pieces, records what it was asked and closed."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces
        self.requests: list[GenerationRequest] = []
        self.closed = 0

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        self.requests.append(request)
        try:
            for i, piece in enumerate(self.pieces):
                last = i == len(self.pieces) - 1
                yield GenerationChunk(
                    text=piece,
                    token_ids=(i,),
                    finish_reason="length" if last else None,
                    prompt_tokens=3 if last else 0,
                    completion_tokens=len(self.pieces) if last else 0,
                )
        finally:
            self.closed += 1

    def num_waiting(self) -> int:
        return 0


@pytest.fixture
def models_root(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    root.mkdir()
    return root


@pytest.fixture
def directory(models_root: Path) -> ModelDirectory:
    return ModelDirectory(ObjectStore(str(models_root)))


@pytest.fixture
def server(directory: ModelDirectory) -> ModelServer:
    return ModelServer(directory)


@pytest.fixture
def make_model(models_root: Path) -> Callable[..., Path]:
    """``make_model("tiny", version="3", weights=True)`` creates a model folder."""
    return functools.partial(_make_model, models_root)


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine(["To be", ", or not", " to be"])


@pytest.fixture
def scripted_server(directory: ModelDirectory, engine: ScriptedEngine) -> ModelServer:
    """A server whose loader hands every model the scripted engine."""

    def load(model: ModelInfo) -> Engine:
        return engine

    return ModelServer(directory, loader=load)


def _client(server: ModelServer) -> httpx.AsyncClient:
    app = make_app("model_server")
    install_openai_api(app, server, TOKEN)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(
        transport=transport, base_url="http://model-server", headers={"Authorization": f"Bearer {TOKEN}"}
    )


@pytest.fixture
async def http(server: ModelServer) -> AsyncIterator[httpx.AsyncClient]:
    """The OpenAI API of ``server`` (no engine), in process."""
    async with _client(server) as client:
        yield client


@pytest.fixture
async def scripted_http(scripted_server: ModelServer) -> AsyncIterator[httpx.AsyncClient]:
    """The OpenAI API of ``scripted_server``, in process."""
    async with _client(scripted_server) as client:
        yield client
