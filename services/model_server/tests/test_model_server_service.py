"""Model directory, validation and the engine seam, without any server."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from forge_kit import errors
from forge_kit.modelref import ModelRef
from forge_model_server.service import (
    ChatMessage,
    GenerationRequest,
    ModelDirectory,
    ModelNotFoundError,
    ModelNotLoadedError,
    ModelServer,
    validate,
)


def test_directory_lists_model_folders_with_version_and_context(
    directory: ModelDirectory, make_model: Callable[..., Path], models_root: Path
) -> None:
    make_model("tiny-llama", version="3", context=512)
    make_model("base")
    (models_root / "not-a-model").mkdir()  # no config.json
    models = directory.list()
    assert [(m.name, m.version, m.max_context_tokens) for m in models] == [
        ("base", "", 256),
        ("tiny-llama", "3", 512),
    ]
    assert models[1].weight_files == ()


def test_get_by_name_and_by_name_version(directory: ModelDirectory, make_model: Callable[..., Path]) -> None:
    make_model("tiny", version="3")
    assert directory.get(ModelRef("tiny")).version == "3"
    assert directory.get(ModelRef("tiny", "3")).name == "tiny"
    with pytest.raises(ModelNotFoundError, match=r"`tiny:4` does not exist \(served models: tiny\)"):
        directory.get(ModelRef("tiny", "4"))


def test_lookup_parses_the_model_once_and_refuses_what_names_no_model(
    server: ModelServer, make_model: Callable[..., Path]
) -> None:
    make_model("tiny", version="3")
    assert server.lookup("tiny:3").name == "tiny" and server.lookup("tiny").version == "3"
    for text in ("../tiny", "tiny:", "tiny:3:4", " tiny", "", "t" * 129, "tiny:4"):
        with pytest.raises(ModelNotFoundError, match=r"does not exist \(served models: tiny\)"):
            server.lookup(text)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"messages": []}, "messages"),
        ({"messages": [ChatMessage("robot", "hi")]}, "messages.0.role"),
        ({"model": " "}, "model"),
        ({"stop": ["ok", ""]}, "stop.1"),
    ],
)
def test_validation_names_the_field(change: dict[str, object], field: str) -> None:
    request = GenerationRequest(model="tiny", messages=[ChatMessage("user", "hello")])
    for key, value in change.items():
        setattr(request, key, value)
    with pytest.raises(errors.ValidationError) as caught:
        validate(request)
    assert caught.value.field == field


def test_validation_accepts_the_bounds() -> None:
    validate(GenerationRequest(model="tiny", prompt="x", max_tokens=1, temperature=2.0, top_p=1.0))
    validate(GenerationRequest(model="tiny", prompt="x", temperature=0.0, top_p=1e-6))
    with pytest.raises(errors.ValidationError, match=r"^prompt:"):
        validate(GenerationRequest(model="tiny"))


async def test_model_without_weights_is_not_loaded(
    server: ModelServer, make_model: Callable[..., Path]
) -> None:
    make_model("tiny")
    with pytest.raises(
        ModelNotLoadedError, match=r"^no model loaded: tiny: no weights \(\*\.safetensors\) in "
    ):
        await server.generate(GenerationRequest(model="tiny", prompt="hi"))


async def test_model_with_weights_but_no_engine_says_why(
    server: ModelServer, make_model: Callable[..., Path]
) -> None:
    make_model("tiny", weights=True)
    with pytest.raises(ModelNotLoadedError) as caught:
        await server.generate(GenerationRequest(model="tiny", prompt="hi"))
    missing = [n for n in ("torch", "transformers") if importlib.util.find_spec(n) is None]
    expected = f"{' and '.join(missing)} not installed" if missing else "no inference engine"
    assert caught.value.message.startswith("no model loaded: tiny: ") and expected in caught.value.message


async def test_unknown_model_is_not_found(server: ModelServer, make_model: Callable[..., Path]) -> None:
    make_model("tiny")
    with pytest.raises(ModelNotFoundError, match="`huge` does not exist"):
        await server.generate(GenerationRequest(model="huge", prompt="hi"))


async def test_invalid_request_is_rejected_before_the_model_is_resolved(server: ModelServer) -> None:
    with pytest.raises(errors.ValidationError, match=r"^max_tokens:"):
        await server.generate(GenerationRequest(model="huge", prompt="hi", max_tokens=0))


async def test_engine_stream_updates_vllm_metrics_and_is_closed(
    scripted_server: ModelServer, make_model: Callable[..., Path], engine: object
) -> None:
    make_model("metered")

    def running() -> float | None:
        return REGISTRY.get_sample_value("vllm:num_requests_running", {"model_name": "metered"})

    before = REGISTRY.get_sample_value(
        "vllm:request_success_total", {"model_name": "metered", "finished_reason": "length"}
    )
    _, chunks = await scripted_server.generate(GenerationRequest(model="metered", prompt="hi"))
    first = await chunks.__anext__()
    assert first.text == "To be" and running() == 1.0
    rest = [c async for c in chunks]
    assert rest[-1].finish_reason == "length" and running() == 0.0
    after = REGISTRY.get_sample_value(
        "vllm:request_success_total", {"model_name": "metered", "finished_reason": "length"}
    )
    assert (after or 0) - (before or 0) == 1
    assert engine.closed == 1  # type: ignore[attr-defined]


async def test_abandoned_stream_cancels_the_engine_request(
    scripted_server: ModelServer, make_model: Callable[..., Path], engine: object
) -> None:
    make_model("tiny")
    _, chunks = await scripted_server.generate(GenerationRequest(model="tiny", prompt="hi"))
    await chunks.__anext__()
    await chunks.aclose()
    assert engine.closed == 1  # type: ignore[attr-defined]
    assert REGISTRY.get_sample_value("vllm:num_requests_running", {"model_name": "tiny"}) == 0.0
