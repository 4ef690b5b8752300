"""The main job's ``chat`` step: what it needs from the steps before it.

The step end to end — the registry promoting, the gateway moving its aliases, the model server
serving the checkpoint under the registry's name, the ``openai`` SDK asking for ``forge-chat`` —
is ``tests/test_model_identity.py`` (real processes of eval, the model server and the gateway).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from forge_kit.modelref import ModelRef
from forge_model_server.main_job import ChatStepError, chat, local_folder, registered_model


@dataclass
class Context:
    """What ``forge_cli.mainjob.MainJobContext`` gives a step, without services."""

    root: Path
    results: dict[str, Mapping[str, Any]] = field(default_factory=dict)

    def endpoint(self, name: str) -> Any:
        raise AssertionError(f"the step must not reach {name} before its inputs are checked")


async def test_without_a_trained_checkpoint_the_step_says_so(tmp_path: Path) -> None:
    ctx = Context(tmp_path, {"train": {"ok": True}, "eval": {"model": "run-7:step-5"}})
    with pytest.raises(ChatStepError, match=r"no trained checkpoint to serve.*steps that ran: train, eval"):
        await chat(ctx)


async def test_without_the_registry_identity_the_step_says_so(tmp_path: Path) -> None:
    """The checkpoint is served under its registry name, or the gateway's aliases miss it."""
    ctx = Context(tmp_path, {"train": {"checkpoint_uri": str(tmp_path)}})
    with pytest.raises(ChatStepError, match=r"registry identity is unknown.*steps that ran: train"):
        await chat(ctx)


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
