"""The model server as a process: probes, metrics, the OpenAI API and gRPC on their ports."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from forge.inference.v1 import inference_pb2, inference_pb2_grpc

from forge_kit.testing import ServiceProcess, base_env

pytestmark = pytest.mark.integration
TOKEN = "process-token"


@pytest.fixture
def process(tmp_path: Path, tiny_llama: Path) -> Iterator[ServiceProcess]:
    shutil.copytree(tiny_llama, tmp_path / "models" / "llama")
    models = tmp_path / "models" / "tiny"
    models.mkdir(parents=True)
    (models / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 64}))
    env = base_env("model_server", token=TOKEN, models_dir=str(tmp_path / "models"), torch_threads="1")
    proc = ServiceProcess(
        "forge_model_server", env=env, cwd=str(tmp_path), log_path=str(tmp_path / "log")
    ).start(30)
    yield proc
    proc.stop()


def test_process_serves_probes_models_and_grpc(process: ServiceProcess) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=process.http_url, timeout=60) as client:
        assert client.get("/readyz").status_code == 200
        assert "vllm:num_requests_waiting" in client.get("/metrics").text
        assert [m["id"] for m in client.get("/v1/models", headers=auth).json()["data"]] == ["llama", "tiny"]
        reply = client.post("/v1/completions", headers=auth, json={"model": "tiny", "prompt": "hi"})
        assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"
        body = {"model": "llama", "prompt": "To be", "max_tokens": 4, "temperature": 0}
        reply = client.post("/v1/completions", headers=auth, json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1 and reply.json()["choices"][0]["text"]
    with grpc.insecure_channel(process.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        reply = stub.ListModels(
            inference_pb2.ListModelsRequest(), metadata=[("authorization", f"Bearer {TOKEN}")]
        )
        assert [m.ref.name for m in reply.models] == ["llama", "tiny"]
