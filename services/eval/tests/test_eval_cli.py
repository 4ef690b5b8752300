"""``forge eval run`` and ``forge eval compare`` over real HTTP against the n-gram endpoint, and the
registry commands against a real eval service process."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from eval_ngram_endpoint import EndpointState, NGramModel, make_app
from test_eval_harness import CORPUS_BAD, CORPUS_GOOD, write_mc_task
from typer.testing import CliRunner

from forge_eval.cli import app
from forge_kit.testing import ServiceProcess, base_env

pytestmark = pytest.mark.integration


@pytest.fixture
def endpoint() -> Iterator[tuple[str, EndpointState]]:
    state = EndpointState(models={"toy": NGramModel(CORPUS_GOOD), "toy-bad": NGramModel(CORPUS_BAD)})
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 10
    while True:
        try:
            if httpx.get(f"{url}/v1/models").status_code == 200:
                break
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    yield url, state
    server.should_exit = True
    thread.join(timeout=5)


def test_run_twice_then_compare(endpoint: tuple[str, EndpointState], tmp_path: Path) -> None:
    url, state = endpoint
    task = str(write_mc_task(tmp_path))
    runner = CliRunner()
    common = [
        "--task",
        task,
        "--endpoint",
        url,
        "--benchmarks-dir",
        str(tmp_path / "benchmarks"),
        "--cache",
        str(tmp_path / "cache.sqlite"),
    ]
    first = runner.invoke(app, ["run", *common, "--model", "toy", "--out", str(tmp_path / "a")])
    assert first.exit_code == 0, first.output
    calls = state.completion_requests
    second = runner.invoke(app, ["run", *common, "--model", "toy", "--out", str(tmp_path / "a2")])
    assert second.exit_code == 0, second.output
    assert state.completion_requests == calls
    a = json.loads((tmp_path / "a" / "summary.json").read_text())
    a2 = json.loads((tmp_path / "a2" / "summary.json").read_text())
    assert a2["calls"]["model_calls"] == 0 and a["spec_hash"] == a2["spec_hash"]
    assert a["tasks"] == a2["tasks"]
    assert (tmp_path / "a" / "report.md").read_text() == (tmp_path / "a2" / "report.md").read_text()
    for key in ("score", "stderr", "ci_low", "ci_high"):
        assert isinstance(a["tasks"]["toy_mc"][key], float)
    bad = runner.invoke(app, ["run", *common, "--model", "toy-bad", "--out", str(tmp_path / "b")])
    assert bad.exit_code == 0, bad.output
    compared = runner.invoke(
        app, ["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--fail-on-regression"]
    )
    assert (
        compared.exit_code == 1 and "gate: BLOCK" in compared.output and "| toy_mc | acc |" in compared.output
    )
    reported = runner.invoke(
        app, ["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--report", str(tmp_path / "r")]
    )
    assert reported.exit_code == 0 and (tmp_path / "r" / "deltas.png").stat().st_size > 1000
    assert "gate: BLOCK" in (tmp_path / "r" / "comparison.md").read_text()
    as_json = runner.invoke(app, ["compare", str(tmp_path / "a"), str(tmp_path / "a2"), "--json"])
    assert json.loads(as_json.output)["decision"] == "PASS"


def test_bad_input_writes_nothing(endpoint: tuple[str, EndpointState], tmp_path: Path) -> None:
    url, _ = endpoint
    bad_task = tmp_path / "bad.yaml"
    bad_task.write_text("name: bad\noutput_type: generate_until\nbogus: 1\n")
    result = CliRunner().invoke(
        app,
        ["run", "--task", str(bad_task), "--endpoint", url, "--model", "toy", "--out", str(tmp_path / "out")],
    )
    assert result.exit_code == 2 and "task.bogus" in result.output
    unknown_model = CliRunner().invoke(
        app,
        [
            "run",
            "--task",
            "bbh",
            "--endpoint",
            url,
            "--model",
            "nope",
            "--out",
            str(tmp_path / "out"),
            "--no-cache",
        ],
    )
    assert unknown_model.exit_code == 2 and "does not serve 'nope'" in unknown_model.output
    assert not (tmp_path / "out").exists()


@pytest.fixture
def eval_service(tmp_path: Path) -> Iterator[ServiceProcess]:
    process = ServiceProcess(
        "forge_eval",
        env=base_env(
            "eval",
            token="service-token",
            data_dir=tmp_path / "eval",
            admin_tokens=json.dumps({"alice": "alice-token"}),
            user_tokens=json.dumps({"ci": "ci-token"}),
        ),
        log_path=str(tmp_path / "eval.log"),
    ).start()
    yield process
    process.stop()


def test_registry_commands_promote_force_and_audit(eval_service: ServiceProcess) -> None:
    runner = CliRunner()

    def forge_eval(*args: str, token: str = "service-token") -> tuple[int, str]:
        result = runner.invoke(
            app, [*args, "--target", eval_service.grpc_target], env={"FORGE_CLI_EVAL_TOKEN": token}
        )
        return result.exit_code, result.output

    code, out = forge_eval("register", "tiny", "--uri", "file:///ckpt/1", "--training-run", "run-1", "--json")
    assert code == 0 and json.loads(out)["stage"] == "candidate", out
    code, out = forge_eval("promote", "tiny:1", "--stage", "production")
    assert code == 1 and "FAILED_PRECONDITION" in out and "has no eval runs" in out
    code, out = forge_eval(
        "promote", "tiny:1", "--stage", "production", "--force", "--reason", "r", token="ci-token"
    )
    assert code == 1 and "PERMISSION_DENIED" in out
    code, out = forge_eval(
        "promote",
        "tiny:1",
        "--stage",
        "production",
        "--force",
        "--reason",
        "bootstrap",
        "--json",
        token="alice-token",
    )
    event = json.loads(out)
    assert code == 0 and (event["forced"], event["actor"], event["to_stage"]) == (True, "alice", "production")
    assert "has no eval runs" in json.loads(event["gate_report"])["summary"]
    code, out = forge_eval("history", "tiny:1", "--forced", "--json")
    assert code == 0 and [(e["actor"], e["reason"]) for e in json.loads(out)] == [("alice", "bootstrap")]
    code, out = forge_eval("models", "--stage", "production", "--json")
    assert code == 0 and [(m["model"], m["training_run"]) for m in json.loads(out)] == [("tiny:1", "run-1")]


def test_rollout_commands_override_the_canary_audited(eval_service: ServiceProcess) -> None:
    """``forge eval rollout status|pause|resume|rollback|promote``: each override is audited with
    who and why, and the canary's state shows it."""
    runner = CliRunner()

    def forge_eval(*args: str, token: str = "alice-token") -> tuple[int, str]:
        result = runner.invoke(
            app, [*args, "--target", eval_service.grpc_target], env={"FORGE_CLI_EVAL_TOKEN": token}
        )
        return result.exit_code, result.output

    for version in ("1", "2", "3"):
        assert forge_eval("register", f"tiny:{version}", "--uri", f"file:///ckpt/{version}")[0] == 0
    forced = ("--force", "--reason", "bootstrap")
    assert forge_eval("promote", "tiny:1", "--stage", "production", *forced)[0] == 0
    assert forge_eval("promote", "tiny:2", "--stage", "canary", "--traffic", "10", *forced)[0] == 0

    code, out = forge_eval("rollout", "pause", "tiny")
    assert code == 2 and "--reason" in out  # the reason is required
    code, out = forge_eval("rollout", "pause", "tiny", "--reason", "waiting for the on-call", "--json")
    assert code == 0 and (json.loads(out)["action"], json.loads(out)["actor"]) == ("pause", "alice")
    code, out = forge_eval("rollout", "status", "tiny", "--json")
    status = json.loads(out)
    assert code == 0 and (status["canary"], status["traffic_percent"], status["paused"]) == (
        "tiny:2",
        10,
        True,
    )
    code, out = forge_eval("rollout", "resume", "tiny:2", "--reason", "on-call here", token="ci-token")
    assert code == 0 and "resume" in out
    code, out = forge_eval(
        "rollout", "rollback", "tiny", "--reason", "latency regression seen by hand", "--json"
    )
    event = json.loads(out)
    assert code == 0 and (event["action"], event["from_stage"], event["to_stage"]) == (
        "rollback",
        "canary",
        "archived",
    )
    code, out = forge_eval("rollout", "status", "tiny", "--json")
    assert (
        json.loads(out)["canary"] == "" and forge_eval("rollout", "rollback", "tiny", "--reason", "x")[0] == 2
    )
    code, out = forge_eval("history", "tiny:2", "--json")
    assert code == 0 and [(e["action"], e["actor"], e["reason"]) for e in json.loads(out)][:3] == [
        ("rollback", "alice", "canary rolled back: latency regression seen by hand"),
        ("resume", "ci", "on-call here"),
        ("pause", "alice", "waiting for the on-call"),
    ]

    # A canary forced past the gate stays behind it: promoting it to production is refused.
    assert forge_eval("promote", "tiny:3", "--stage", "canary", "--traffic", "10", *forced)[0] == 0
    code, out = forge_eval("rollout", "promote", "tiny", "--reason", "looks good")
    assert code == 1 and "release gate: model tiny:3 has no eval runs" in out
