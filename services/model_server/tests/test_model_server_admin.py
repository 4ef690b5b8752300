"""The admin API: registering a Hugging Face folder at run time, served by the real engine."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
from transformers import PreTrainedTokenizerFast

from forge_kit.http import make_app
from forge_kit.objectstore import ObjectStore
from forge_model_server.engine.async_engine import HFEngineLoader
from forge_model_server.engine.core import EngineConfig
from forge_model_server.entrypoints.admin_api import install_admin_api
from forge_model_server.entrypoints.openai_api import install_openai_api
from forge_model_server.service import ModelDirectory, ModelServer

TOKEN = "admin-token"
ADMIN = "/admin/v1/models"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory: pytest.TempPathFactory, save_llama: Callable[..., Path]) -> Path:
    """A trained-checkpoint stand-in: tiny Llama, tokenizer with a chat template, outside any models dir."""
    return save_llama(tmp_path_factory.mktemp("export") / "hf", chat_template=CHAT_TEMPLATE, seed=3)


@pytest.fixture
async def server(tmp_path: Path, tiny_llama: Path) -> AsyncIterator[ModelServer]:
    shutil.copytree(tiny_llama, tmp_path / "models" / "tiny")
    loader = HFEngineLoader(EngineConfig(num_blocks=64, block_size=8), max_waiting=8)
    server = ModelServer(ModelDirectory(ObjectStore(str(tmp_path / "models"))), loader=loader)
    yield server
    await server.drain(0)


@pytest.fixture
async def http(server: ModelServer) -> AsyncIterator[httpx.AsyncClient]:
    app = make_app("model_server")
    install_openai_api(app, server, TOKEN)
    install_admin_api(app, server, TOKEN)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://model-server", headers={"Authorization": f"Bearer {TOKEN}"}
    ) as client:
        yield client


async def test_a_registered_checkpoint_is_listed_and_chats_with_its_template(
    http: httpx.AsyncClient, chat_llama: Path
) -> None:
    reply = await http.post(
        ADMIN, json={"name": "forge-main-job", "path": str(chat_llama), "version": "run1-5"}
    )
    assert reply.status_code == 201, reply.text
    card = reply.json()
    assert card["id"] == "forge-main-job" and card["version"] == "run1-5" and card["loaded"] is True
    assert card["path"] == str(chat_llama) and card["max_model_len"] == 256
    assert card["root"] == "forge-main-job"
    listed = (await http.get("/v1/models")).json()["data"]
    assert [(m["id"], m["loaded"]) for m in listed] == [("forge-main-job", True), ("tiny", False)]

    body = {
        "model": "forge-main-job:run1-5",
        "messages": [{"role": "user", "content": "To be"}],
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with http.stream("POST", "/v1/chat/completions", json=body) as stream:
        assert stream.status_code == 200
        events = [
            json.loads(line[6:]) for line in [x async for x in stream.aiter_lines()] if line[6:7] == "{"
        ]
    text = "".join(c["delta"].get("content", "") for e in events for c in e["choices"])
    usage = events[-1]["usage"]
    # The prompt went through the folder's own chat template.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(chat_llama))
    rendered = "<|user|>To be\n<|assistant|>"
    assert usage["prompt_tokens"] == len(tokenizer.encode(rendered))
    assert usage["completion_tokens"] >= 1 and (text or usage["completion_tokens"] < 6)


async def test_registering_again_replaces_the_model(
    http: httpx.AsyncClient, chat_llama: Path, tmp_path: Path, save_llama: Callable[..., Path]
) -> None:
    other = save_llama(tmp_path / "other", seed=9)
    assert (await http.post(ADMIN, json={"name": "m", "path": str(chat_llama)})).status_code == 201
    first = await http.post(
        "/v1/completions", json={"model": "m", "prompt": "To be", "max_tokens": 6, "temperature": 0}
    )
    reply = await http.post(ADMIN, json={"name": "m", "path": str(other), "version": "2"})
    assert reply.status_code == 201 and reply.json()["path"] == str(other)
    second = await http.post(
        "/v1/completions", json={"model": "m", "prompt": "To be", "max_tokens": 6, "temperature": 0}
    )
    assert (
        second.status_code == 200
        and second.json()["choices"][0]["text"] != first.json()["choices"][0]["text"]
    )
    cards = (await http.get("/v1/models")).json()["data"]
    assert [(m["id"], m["version"]) for m in cards] == [("m", "2"), ("tiny", "")]


async def test_the_admin_api_needs_the_service_token(http: httpx.AsyncClient, chat_llama: Path) -> None:
    reply = await http.post(
        ADMIN, json={"name": "x", "path": str(chat_llama)}, headers={"Authorization": "Bearer nope"}
    )
    assert reply.status_code == 401


def _folder(root: Path, *files: str) -> str:
    root.mkdir(parents=True)
    for name in files:
        (root / name).write_text(json.dumps({"model_type": "llama"}))
    return str(root)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"name": "bad/name"}, "name", "letters, digits"),
        ({"name": ""}, "name", "letters, digits"),
        ({"name": "tiny"}, "name", "already a folder of the model directory"),
        ({"version": "a:b"}, "version", "at most 64"),
        ({"path": ""}, "path", "is required"),
        ({"path": "relative/dir"}, "path", "must be absolute"),
        ({"path": "s3://bucket/model"}, "path", "not a URL"),
        ({"path": "/nonexistent/forge/model"}, "path", "is not a directory"),
        ({"path": "EMPTY"}, "path", "has no config.json"),
        ({"path": "CONFIG_ONLY"}, "path", "has no tokenizer"),
        ({"path": "NO_WEIGHTS"}, "path", "has no weights"),
        ({"path": "NOT_LLAMA"}, "path", "model_type is 'gpt2'"),
        ({"extra": 1}, "extra", "Extra inputs are not permitted"),
    ],
)
async def test_bad_input_is_400_naming_the_field(
    http: httpx.AsyncClient,
    chat_llama: Path,
    tmp_path: Path,
    body: dict[str, object],
    param: str,
    message: str,
) -> None:
    folders = {
        "EMPTY": _folder(tmp_path / "empty"),
        "CONFIG_ONLY": _folder(tmp_path / "config-only", "config.json"),
        "NO_WEIGHTS": _folder(tmp_path / "no-weights", "config.json", "tokenizer.json"),
    }
    not_llama = shutil.copytree(chat_llama, tmp_path / "gpt2")
    (not_llama / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    folders["NOT_LLAMA"] = str(not_llama)
    request = {"name": "new-model", "path": str(chat_llama), **body}
    request["path"] = folders.get(str(request["path"]), request["path"])
    reply = await http.post(ADMIN, json=request)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and message in error["message"]
    assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == ["tiny"]
