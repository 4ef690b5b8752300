"""A deployment's spec checks and the command a vLLM replica runs (no process started)."""

from __future__ import annotations

import pytest

from forge_kit import errors
from forge_kit.jobenv import SERVE_PORT_PLACEHOLDER
from forge_orchestrator.deploy.model import DeploymentInput, replica_command, validate_deployment


def _vllm(*engine_args: str) -> DeploymentInput:
    return DeploymentInput(
        name="chat",
        team="serving",
        model="tiny:3",
        model_dir="/models/tiny",
        engine="vllm",
        replicas=1,
        gpu_type="SIM",
        engine_args=list(engine_args),
        replica_token="s3cret-token",
    )


def test_a_vllm_replica_runs_the_kits_command_with_its_credential_out_of_argv() -> None:
    spec = _vllm("--max-num-seqs=8", "--enforce-eager")
    validate_deployment(spec)
    replica = replica_command(spec)
    argv = replica.command
    assert argv[:3] == [spec.vllm_python, "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--port") + 1] == SERVE_PORT_PLACEHOLDER
    # Its name, and its pinned version as the gateway sends it upstream.
    assert argv[argv.index("--served-model-name") + 1 : argv.index("--host")] == ["tiny", "tiny:3"]
    assert "--enforce-eager" in argv and argv[argv.index("--max-num-seqs") + 1] == "8"
    # The gateway sends admission levels as vLLM's priority.
    assert argv[argv.index("--scheduling-policy") + 1] == "priority"
    assert not any("s3cret-token" in arg for arg in argv)
    assert replica.env["VLLM_API_KEY"] == "s3cret-token"


@pytest.mark.parametrize(
    "engine_args",
    [["--trust-remote-code"], ["--chat-template", "/etc/shadow"], ["--port=1"], ["--api-key=x"]],
)
def test_vllm_flags_beyond_the_kits_allowlist_are_refused(engine_args: list[str]) -> None:
    with pytest.raises(errors.ValidationError, match=r"spec\.engine_args"):
        validate_deployment(_vllm(*engine_args))
