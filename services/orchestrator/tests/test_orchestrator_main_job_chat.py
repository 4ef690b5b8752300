"""The main job's ``serve`` and ``chat`` steps: what they need from the steps before them, and
the deployment they ask for.

End to end they run in ``forge up`` (the deployment's replica a vLLM process placed by the
scheduler); the registry-to-answer identity they rely on is ``tests/test_model_identity.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from forge.orchestrator.v1 import orchestrator_pb2

from forge_kit.modelref import ModelRef
from forge_orchestrator.deploy.model import DeploymentInput, replica_command, validate_deployment
from forge_orchestrator.main_job.chat import ChatStepError, chat, local_folder, registered_model
from forge_orchestrator.main_job.serve import ServeStepError, serve, spec_of, trained_export


@dataclass
class Context:
    """What ``forge_cli.mainjob.MainJobContext`` gives a step, without services."""

    root: Path
    results: dict[str, Mapping[str, Any]] = field(default_factory=dict)

    def endpoint(self, name: str) -> Any:
        raise AssertionError(f"the step must not reach {name} before its inputs are checked")


TRAINED = {"checkpoint_uri": "var/objects/run-7/hf", "checkpoint_id": "run-7:step-5"}


async def test_without_a_trained_checkpoint_the_steps_say_so(tmp_path: Path) -> None:
    ctx = Context(tmp_path, {"train": {"ok": True}, "eval": {"model": "run-7:step-5"}})
    for step in (serve, chat):
        with pytest.raises(
            ServeStepError, match=r"no trained checkpoint to serve.*steps that ran: train, eval"
        ):
            await step(ctx)


async def test_without_the_serve_steps_deployment_chat_says_so(tmp_path: Path) -> None:
    ctx = Context(tmp_path, {"train": TRAINED, "eval": {"model": "run-7:step-5"}})
    with pytest.raises(ChatStepError, match=r"no deployment.*steps that ran: train, eval"):
        await chat(ctx)


async def test_without_the_registry_identity_the_step_says_so(tmp_path: Path) -> None:
    """The checkpoint is served under its registry name, or the gateway's aliases miss it."""
    ctx = Context(tmp_path, {"train": TRAINED, "serve": {"deployment": "main-job-chat"}})
    with pytest.raises(ChatStepError, match=r"registry identity is unknown.*steps that ran: train, serve"):
        await chat(ctx)


def test_the_trained_model_is_deployed_on_vllm_under_its_registry_identity(tmp_path: Path) -> None:
    """What the serve step asks the Deploy API for: the export, named as the registry names it,
    on one vLLM replica of one of the agents' simulated GPUs; a spec the deployment accepts."""
    trained = trained_export(Context(tmp_path, {"train": TRAINED}))
    assert trained.model == ModelRef("run-7", "step-5") and trained.path == tmp_path / "var/objects/run-7/hf"
    spec = spec_of("main-job-chat", trained)
    assert spec.engine == orchestrator_pb2.ENGINE_VLLM
    assert (spec.min_replicas, spec.max_replicas, spec.resources.gpu_type) == (1, 1, "SIM")
    deployment = DeploymentInput(
        name=spec.name,
        team=spec.team,
        model=spec.model,
        model_dir=spec.model_dir,
        engine="vllm",
        replicas=1,
        gpu_type=spec.resources.gpu_type,
        engine_args=list(spec.engine_args),
    )
    validate_deployment(deployment)
    argv = replica_command(deployment).command
    assert argv[argv.index("--model") + 1] == str(trained.path)
    # The gateway sends forge-chat's pinned version upstream as run-7:step-5: the replica answers to it.
    assert argv[argv.index("--served-model-name") + 1 : argv.index("--host")] == ["run-7", "run-7:step-5"]


def test_the_registry_identity_is_a_model_ref(tmp_path: Path) -> None:
    ctx = Context(tmp_path, {"eval": {"model": "run-7:step-5"}})
    assert registered_model(ctx) == ModelRef("run-7", "step-5")
    ctx.results["eval"] = {"model": "run 7:step/5"}
    with pytest.raises(ChatStepError, match=r"invalid model.*'run 7:step/5'"):
        registered_model(ctx)


def test_only_checkpoint_folders_on_this_machine_are_served(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    assert local_folder(str(folder), tmp_path) is None  # no config.json
    (folder / "config.json").write_text("{}")
    assert local_folder(str(folder), Path("/elsewhere")) == folder
    assert local_folder(f"file://{folder}", Path("/elsewhere")) == folder
    assert local_folder("ckpt", tmp_path) == folder
    assert local_folder("s3://bucket/ckpt", tmp_path) is None
