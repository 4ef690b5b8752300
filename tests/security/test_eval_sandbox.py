"""Issue 22, hole 2, from the attacker's side: model-generated code run by the HumanEval scorer
(and anything else using ``forge_kit.sandbox``) tries to read host secrets, write outside its
scratch space, reach local services, exhaust processes, outlive its timeout and read the host's
environment. Every attempt must fail; honest code must still pass."""

from __future__ import annotations

import json
import os
import secrets
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from forge_kit.sandbox import SandboxLimits, SandboxResult, SandboxUnavailableError, run_python

#: The programs end by themselves (the longest sleeps 3 s); the timeout only bounds a broken
#: sandbox, with room for a loaded machine starting Python slowly.
LIMITS = SandboxLimits(timeout_s=30.0, memory_bytes=512 << 20, max_processes=64)
PG_SOCKET = "/var/run/postgresql/.s.PGSQL.5432"


def run(code: str, limits: SandboxLimits = LIMITS, **kwargs: object) -> SandboxResult:
    return run_python(code, limits, **kwargs)  # type: ignore[arg-type]


def _report(path: str) -> str:
    """Code that prints what reading ``path`` gave."""
    return (
        "try:\n"
        f"    print('READ', open({path!r}, 'rb').read()[:200])\n"
        "except OSError as exc:\n"
        "    print('DENIED', type(exc).__name__)\n"
    )


def test_etc_shadow_is_not_readable() -> None:
    result = run(_report("/etc/shadow"))
    assert result.passed, result.output
    assert "READ" not in result.output and "DENIED" in result.output


def test_a_secrets_file_is_not_readable(tmp_path: Path) -> None:
    token = secrets.token_hex(16)
    tokens = tmp_path / "var" / "secrets" / "tokens.json"
    tokens.parent.mkdir(parents=True)
    tokens.write_text(json.dumps({"eval": token}))
    tokens.chmod(0o644)  # even world-readable: it is simply not there
    result = run(_report(str(tokens)))
    assert token not in result.output and "DENIED" in result.output


def test_a_service_database_is_not_readable(tmp_path: Path) -> None:
    secret = secrets.token_hex(16)
    db = tmp_path / "var" / "data" / "scheduler.sqlite"
    db.parent.mkdir(parents=True)
    with sqlite3.connect(db) as conn:
        conn.execute("create table tokens (value text)")
        conn.execute("insert into tokens values (?)", (secret,))
    db.chmod(0o644)
    code = (
        "import sqlite3\n"
        "try:\n"
        f"    con = sqlite3.connect('file:{db}?mode=ro', uri=True)\n"
        "    print('READ', con.execute('select value from tokens').fetchall())\n"
        "except sqlite3.Error as exc:\n"
        "    print('DENIED', exc)\n"
    )
    result = run(code)
    assert secret not in result.output and "DENIED" in result.output


def test_a_root_only_file_bound_in_stays_unreadable(tmp_path: Path) -> None:
    """The program's kernel-level identity is not root: a 0600 root file, even when visible, is
    refused; and the host sees the program's process under the unprivileged uid."""
    secret = tmp_path / "root-only"
    secret.write_text("top secret")
    secret.chmod(0o600)
    result = run(
        _report(str(secret)) + "import os\nprint('IDS', os.getresuid(), os.getresgid())\n",
        readonly_files=[str(secret)],
    )
    assert "top secret" not in result.output and "DENIED PermissionError" in result.output
    assert "IDS (0," not in result.output


def _processes_with(marker: str) -> list[int]:
    """Host pids whose command line holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline and int(entry) != os.getpid():
                found.append(int(entry))
    return found


def _host_uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid in /proc/{pid}/status")


def test_the_host_sees_the_program_run_unprivileged() -> None:
    marker = f"forge-sandbox-uid-{secrets.token_hex(6)}"
    code = f"import os, sys, time\nos.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(3)', {marker!r}])\n"
    worker = threading.Thread(target=run, args=(code,))
    worker.start()
    try:
        deadline = time.monotonic() + 30
        pids: list[int] = []
        while not pids and time.monotonic() < deadline:
            pids = [p for p in _processes_with(marker) if b"-c" in Path(f"/proc/{p}/cmdline").read_bytes()]
            time.sleep(0.05)
        assert pids, "the sandboxed program never showed up"
        assert all(_host_uid(p) != 0 for p in pids), [(_host_uid(p), p) for p in pids]
    finally:
        worker.join()


def test_writes_outside_the_scratch_space_do_not_reach_the_host(tmp_path: Path) -> None:
    escaped = tmp_path / "escaped.txt"
    host_tmp = Path("/tmp") / f"forge-sandbox-escape-{secrets.token_hex(6)}"
    code = ""
    for target in (escaped, host_tmp):
        code += f"try:\n    open({str(target)!r}, 'w').write('pwned')\nexcept OSError as exc:\n    print('refused', exc)\n"
    try:
        run(code)
        assert not escaped.exists()
        assert not host_tmp.exists()
    finally:
        host_tmp.unlink(missing_ok=True)


@pytest.fixture
def unix_service(tmp_path: Path) -> Iterator[str]:
    """A local service listening on a unix socket in a host directory (like PostgreSQL's)."""
    path = str(tmp_path / "svc.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    os.chmod(path, 0o777)
    server.listen(8)
    yield path
    server.close()


def test_local_services_are_unreachable(unix_service: str) -> None:
    """PostgreSQL's unix socket and TCP port, and a service's own unix socket, with the socket
    module reloaded past any Python-level guard."""
    targets = [unix_service] + ([PG_SOCKET] if os.path.exists(PG_SOCKET) else [])
    code = "import importlib, socket\nsocket = importlib.reload(socket)\n"
    for path in targets:
        code += (
            "try:\n    s = socket.socket(socket.AF_UNIX)\n"
            f"    s.connect({path!r})\n    print('CONNECTED', {path!r})\n"
            "except OSError as exc:\n    print('blocked', exc)\n"
        )
    code += (
        "try:\n    socket.create_connection(('127.0.0.1', 5432), timeout=2)\n    print('CONNECTED tcp')\n"
        "except OSError as exc:\n    print('blocked', exc)\n"
    )
    result = run(code)
    assert "CONNECTED" not in result.output and result.output.count("blocked") == len(targets) + 1, (
        result.output
    )


def test_the_raw_socket_module_reaches_nothing(unix_service: str) -> None:
    code = (
        "import _socket\n"
        f"for family, address in ((_socket.AF_UNIX, {unix_service!r}), (_socket.AF_INET, ('127.0.0.1', 5432)),"
        " (_socket.AF_INET, ('127.0.0.1', 6379))):\n"
        "    s = _socket.socket(family, _socket.SOCK_STREAM)\n"
        "    s.settimeout(2)\n"
        "    try:\n        s.connect(address)\n        print('CONNECTED', address)\n"
        "    except OSError as exc:\n        print('blocked', exc)\n"
    )
    result = run(code)
    assert "CONNECTED" not in result.output and result.output.count("blocked") == 3, result.output


def test_a_fork_bomb_is_capped() -> None:
    code = (
        "import os, time\n"
        "made = 0\n"
        "for _ in range(200):\n"
        "    try:\n        pid = os.fork()\n"
        "    except OSError:\n        break\n"
        "    if pid == 0:\n"
        "        os.close(1); os.close(2)\n        time.sleep(3)\n        os._exit(0)\n"
        "    made += 1\n"
        "print('FORKED', made)\n"
    )
    result = run(code)
    forked = int(result.output.split("FORKED", 1)[1].split()[0])
    assert forked < 64, result.output


def test_a_setsid_child_dies_with_the_timeout(tmp_path: Path) -> None:
    marker = f"forge-sandbox-survivor-{secrets.token_hex(6)}"
    flag = tmp_path / "survived"
    survivor = f"import time; time.sleep(4); open({str(flag)!r}, 'w').write('x')"
    code = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    devnull = os.open('/dev/null', os.O_RDWR)\n"
        "    os.dup2(devnull, 1); os.dup2(devnull, 2)\n"
        f"    os.execv(sys.executable, [sys.executable, '-c', {survivor!r}, {marker!r}])\n"
        "time.sleep(60)\n"
    )
    result = run(code, SandboxLimits(timeout_s=1.0))
    assert result.status == "timeout", result.output
    deadline = time.monotonic() + 30  # the kernel reaps the killed namespace's processes
    while (left := _processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == []
    time.sleep(4)
    assert not flag.exists()


def test_the_hosts_environment_is_not_readable(tmp_path: Path) -> None:
    """Neither inherited nor read through /proc: a "service" holds a token in its environment."""
    token = secrets.token_hex(16)
    service = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)"],
        env={**os.environ, "FORGE_SERVICE_TOKEN": token},
    )
    try:
        code = (
            "import os, json\n"
            "print('ENV', json.dumps(dict(os.environ)))\n"
            "for pid in [str(os.getppid()), '1', 'self'] + (os.listdir('/proc') if os.path.isdir('/proc') else []):\n"
            "    try:\n        print(open(f'/proc/{pid}/environ', 'rb').read())\n"
            "    except OSError:\n        pass\n"
        )
        os.environ["FORGE_EVAL_LEAK_CHECK"] = token
        try:
            result = run(code)
        finally:
            del os.environ["FORGE_EVAL_LEAK_CHECK"]
        assert result.passed, result.output
        assert token not in result.output
        environ = json.loads(result.output.split("ENV ", 1)[1].splitlines()[0])
        assert set(environ) <= {"PWD", "LC_CTYPE"}, environ
    finally:
        service.kill()
        service.wait()


def test_refuses_to_run_without_bubblewrap(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    flag = tmp_path / "ran"
    monkeypatch.setenv("FORGE_SANDBOX_BWRAP", str(tmp_path / "no-such-bwrap"))
    with pytest.raises(SandboxUnavailableError, match="code execution is refused"):
        run(f"open({str(flag)!r}, 'w').write('x')\n")
    assert not flag.exists()


def test_honest_code_still_runs() -> None:
    ok = run(
        "import math, itertools\nassert sum(math.factorial(i) for i in range(6)) == 154\nprint('done')\n"
    )
    assert ok.passed and ok.status == "passed" and "done" in ok.output
    bad = run("def add(a, b):\n    return a - b\nassert add(2, 2) == 4, 'wrong sum'\n")
    assert not bad.passed and bad.status == "failed" and "wrong sum" in bad.output
