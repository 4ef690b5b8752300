"""``serve_model`` runs on vLLM (``model_server_engine: vllm``): eval starts vLLM's OpenAI-compatible
server from vLLM's own environment on the registered checkpoint folder, scores the run through it
and stops it. The same perplexity run served by Forge's model server gives the same per-document
bits per byte (float32 on both sides), so a run's figures do not depend on which engine eval
started. A checkpoint vLLM cannot launch fails the run with the reason, and no server is left."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import sqlalchemy as sa

from forge_eval.registry import ModelRegistry
from forge_eval.runs import RunService
from forge_eval.serving import LocalModelServer, ModelHost, VllmModelServer
from forge_eval.store.runs import ExampleRow, RunStatus
from forge_eval.task_runner import TaskCatalog, TaskSuiteRunner
from forge_eval.tasks import DataRoots
from forge_kit.db import Database
from forge_kit.paths import resolve_data_path
from forge_kit.testing.requires import missing
from forge_kit.testing.tiny_llama import save_tiny_llama
from forge_kit.vllm import vllm_available

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

SUITE = "tinyshakespeare_ppl"
DOCS = 4
#: vLLM as Forge's engine computes (float32), small and on one thread.
ENGINE_ARGS = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 4, "enforce_eager": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Llama with one head of 64 (a head size vLLM's CPU attention serves)."""
    if not vllm_available():
        missing("no vLLM environment: `make install` builds .venv-vllm")
    return save_tiny_llama(tmp_path_factory.mktemp("ckpt") / "hf", heads=1, kv_heads=1, context=256)


def _service(db: Database, host: ModelHost) -> RunService:
    """Eval's run service as its process builds it (the shipped tasks over the data folder)."""
    roots = DataRoots(resolve_data_path("benchmarks"), resolve_data_path("corpora"))
    runner = TaskSuiteRunner(roots, cache_path=None)
    return RunService(db, TaskCatalog(roots), runner, default_endpoint="http://127.0.0.1:9/", model_host=host)


async def _run(db: Database, runs: RunService) -> tuple[RunStatus, str, list[float], str]:
    """Status, error, per-example scores (in example order) and endpoint of one served run."""
    queued = await runs.run_suite(
        SUITE, "tiny", "3", endpoint="", limit=DOCS, seed=0, options={}, serve_model=True
    )
    assert await runs.claim_next_run() == queued.id
    run = await runs.execute_run(queued.id)
    async with db.session() as session:
        rows = await session.scalars(
            sa.select(ExampleRow)
            .where(ExampleRow.run_id == queued.id)
            .order_by(ExampleRow.example_id, ExampleRow.metric)
        )
        scores = [row.score for row in rows]
    return run.status, run.error, scores, run.endpoint


async def test_a_served_run_on_vllm_scores_as_on_forges_engine(
    db: Database, checkpoint: Path, tmp_path: Path
) -> None:
    await ModelRegistry(db).register_model("tiny", "3", str(checkpoint), {})
    vllm = VllmModelServer(
        work_dir=tmp_path / "vllm", engine_args=ENGINE_ARGS, threads=1, start_timeout_s=600
    )
    status, error, on_vllm, endpoint = await _run(db, _service(db, vllm))
    assert status == RunStatus.SUCCEEDED, error
    assert len(on_vllm) >= DOCS and all(math.isfinite(s) and s > 1.0 for s in on_vllm)  # random: bits
    assert endpoint.startswith("http://127.0.0.1:")
    assert not any((tmp_path / "vllm").iterdir())  # stopped, its folder removed

    forge = LocalModelServer(work_dir=tmp_path / "forge", env={"FORGE_MODEL_SERVER_TORCH_THREADS": "1"})
    status, error, on_forge, _ = await _run(db, _service(db, forge))
    assert status == RunStatus.SUCCEEDED, error
    assert on_vllm == pytest.approx(on_forge, abs=1e-4)


async def test_a_checkpoint_vllm_cannot_launch_fails_the_run_with_the_reason(
    db: Database, tmp_path: Path
) -> None:
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    await ModelRegistry(db).register_model("tiny", "3", str(folder), {})
    bad_python = VllmModelServer(str(tmp_path / "no-such-python"), tmp_path / "vllm", engine_args=ENGINE_ARGS)
    status, error, scores, _ = await _run(db, _service(db, bad_python))
    assert status == RunStatus.FAILED and scores == []
    assert "no-such-python" in error
