"""Registered model endpoints: which spellings are the same address, what each one is sent, and
which model a pinned run asks an endpoint for."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from forge_eval.endpoints import EndpointRegistry, normalize_endpoint
from forge_eval.runner import OpenAICompletionsRunner, RunnerError
from forge_eval.spec import RunSpec
from forge_kit import errors
from forge_kit.paths import data_dir


def test_spellings_of_one_address_share_its_credential_and_others_get_none() -> None:
    registry = EndpointRegistry({"http://Gateway:8080/": "key", "https://ms.internal/v1": "", "": "ignored"})
    assert registry.urls() == ["http://gateway:8080", "https://ms.internal/v1"]
    for same in ("http://gateway:8080", "HTTP://GATEWAY:8080/", " http://gateway:8080 "):
        assert registry.is_registered(same) and registry.credential(same) == "key"
    for other in ("http://gateway:8081", "http://gateway", "http://gateway:8080/v1", "http://evil:8080"):
        assert not registry.is_registered(other) and registry.credential(other) == ""
    assert registry.credential("not a url") == ""


@pytest.mark.parametrize(
    "bad",
    [
        "ftp://gateway",
        "http://",
        "http://user:pw@gateway:8080",
        "http://gateway:8080/?x=1",
        "http://gateway:8080/#f",
        "http://gateway:8080/a/../b",
        "http://gate way",
        "http://gateway:99999",
    ],
)
def test_urls_that_could_land_elsewhere_or_carry_secrets_are_refused(bad: str) -> None:
    with pytest.raises(errors.ValidationError) as caught:
        normalize_endpoint(bad)
    assert caught.value.field == "endpoint"


def test_ipv6_literals_keep_their_brackets() -> None:
    assert normalize_endpoint("http://[::1]:8000/") == "http://[::1]:8000"


def _endpoint(version: str, asked: list[str]) -> FastAPI:
    """An endpoint that lists ``tiny`` by name only, declaring ``version``, as the gateway does
    with a canary of the same name: it answers ``tiny``, ``tiny:v2`` and ``tiny:v3``, and refuses
    any other model as the gateway does."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "tiny", "version": version}]}

    @app.post("/v1/completions")
    async def completions(body: dict[str, Any]) -> JSONResponse:
        asked.append(body["model"])
        if body["model"] not in ("tiny", "tiny:v2", "tiny:v3"):
            return JSONResponse({"error": {"code": "model_not_found"}}, status_code=404)
        return JSONResponse(
            {"object": "text_completion", "choices": [{"index": 0, "text": " 7", "finish_reason": "stop"}]}
        )

    return app


def _spec(version: str) -> RunSpec:
    return RunSpec(
        suite="gsm8k",
        datasets={},
        model_name="tiny",
        model_version=version,
        sampling={"max_tokens": 4, "temperature": 0.0, "top_p": 1.0},
        seed=0,
        limit=2,
        scorer_version="gsm8k-gen-1",
    )


async def test_a_pinned_run_asks_for_its_version_only() -> None:
    """An endpoint that lists a model by name only, showing one version (the gateway, when a
    canary serves another version of the name): a pinned run asks for ``name:version`` — its
    own version, whichever the card shows — and fails where that version is not served, rather
    than score another."""
    asked: list[str] = []
    runner = OpenAICompletionsRunner(
        data_dir() / "benchmarks", transport=httpx.ASGITransport(app=_endpoint("v2", asked))
    )
    assert await runner.run(_spec("v3"), "http://gateway") and set(asked) == {"tiny:v3"}
    asked.clear()
    assert await runner.run(_spec("v2"), "http://gateway") and set(asked) == {"tiny:v2"}
    with pytest.raises(RunnerError, match="refused a completion"):
        await runner.run(_spec("v4"), "http://gateway")
    # An endpoint that declares no version is asked by name, as before.
    unversioned: list[str] = []
    runner = OpenAICompletionsRunner(
        data_dir() / "benchmarks", transport=httpx.ASGITransport(app=_endpoint("", unversioned))
    )
    await runner.run(_spec("v3"), "http://gateway")
    assert set(unversioned) == {"tiny"}
