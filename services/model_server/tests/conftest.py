from __future__ import annotations

import functools
import json
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import httpx
import pytest

from forge_kit.http import make_app
from forge_kit.objectstore import ObjectStore
from forge_kit.testing.tiny_llama import save_tiny_llama as save_random_llama
from forge_model_server.entrypoints.openai_api import install_openai_api
from forge_model_server.service import (
    Engine,
    GenerationChunk,
    GenerationRequest,
    ModelDirectory,
    ModelInfo,
    ModelServer,
)

# Test modules share helpers by importing each other (test_model_server_live's live server).
sys.path.insert(0, str(Path(__file__).parent))

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

    def tokenize(self, request: GenerationRequest) -> list[int]:
        """One id per whitespace-separated word of the prompt or of the messages' contents."""
        text = request.prompt if request.messages is None else " ".join(m.content for m in request.messages)
        return list(range(len((text or "").split())))


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


TINY_CORPUS = (
    "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer "
    "the slings and arrows of outrageous fortune, or to take arms against a sea of troubles "
    "and by opposing end them. To die: to sleep; no more; and by a sleep to say we end the "
    "heart-ache and the thousand natural shocks that flesh is heir to."
)


def save_tiny_llama(
    folder: Path, *, chat_template: str | None = None, seed: int = 0, context: int = 256
) -> Path:
    """A randomly initialised tiny Llama (2 layers, hidden 64, 4 heads, 2 KV heads) with a
    byte-level BPE tokenizer, saved in Hugging Face format exactly as the trainer exports. Weights
    are drawn wider than the default 0.02 so greedy choices are not near-ties that rounding could
    flip."""
    return save_random_llama(
        folder,
        corpus=[TINY_CORPUS] * 4,
        context=context,
        seed=seed,
        chat_template=chat_template,
        initializer_range=0.2,
    )


@pytest.fixture(scope="session")
def save_llama() -> Callable[..., Path]:
    """``save_llama(folder, chat_template=..., seed=...)``: a tiny Llama saved as a trained export."""
    return save_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama, saved once per session (a model folder outside any models dir)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """These models are tiny: one intra-op thread is as fast alone and far faster on a busy machine
    (torch's one-thread-per-core pool made each small matmul ~17x slower under load)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
