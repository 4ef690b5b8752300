"""HumanEval's sandbox: real programs that pass, fail, hang, allocate without bound or try the
network; pass@k against the unbiased estimator's definition. (The attacker's side is in
``tests/security/test_eval_sandbox.py``.)"""

from __future__ import annotations

import json
import math

import pytest

from forge_eval.scorers import get_scorer, pass_at_k
from forge_eval.tasks import DataRoots, build_docs, load_task
from forge_kit.paths import resolve_data_path
from forge_kit.sandbox import SandboxLimits, SandboxUnavailableError, run_python

#: Every program given these ends by itself (or by a limit other than time) in well under a second;
#: the timeout only bounds a broken sandbox, so a loaded machine starting Python slowly never hits it.
LIMITS = SandboxLimits(timeout_s=30.0, memory_bytes=256 << 20)


def test_a_passing_and_a_failing_program() -> None:
    assert run_python("assert sum([1, 2]) == 3\n", LIMITS).passed
    failed = run_python("assert 1 == 2, 'nope'\n", LIMITS)
    assert not failed.passed and failed.status == "failed" and "nope" in failed.output


def test_an_infinite_loop_is_killed_at_the_timeout() -> None:
    result = run_python("while True:\n    pass\n", SandboxLimits(timeout_s=0.5))
    assert not result.passed and result.status in {"timeout", "killed by SIGXCPU", "killed by SIGKILL"}


def test_memory_is_bounded() -> None:
    result = run_python("x = bytearray(1 << 30)\nprint('allocated')\n", LIMITS)
    assert not result.passed and "allocated" not in result.output


def test_output_is_bounded() -> None:
    result = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", LIMITS)
    assert not result.passed and len(result.output) <= 2000


def test_no_network_and_a_private_working_directory() -> None:
    code = (
        "import socket, os\n"
        "try:\n    socket.create_connection(('127.0.0.1', 5432), timeout=1)\n    print('CONNECTED')\n"
        "except OSError as exc:\n    print('blocked', exc)\n"
        "assert os.listdir('.') == ['program.py'], os.listdir('.')\n"
        "open('/tmp/scratch', 'w').write('ok')\n"
    )
    result = run_python(code, LIMITS)
    assert result.passed, result.output
    assert "CONNECTED" not in result.output and "blocked" in result.output


def test_pass_at_k_matches_the_combinatorial_definition() -> None:
    for n, c, k in [(10, 3, 1), (10, 3, 5), (20, 0, 1), (5, 5, 2), (200, 13, 10)]:
        expected = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(expected)


def _roots() -> DataRoots:
    return DataRoots(resolve_data_path("benchmarks"), resolve_data_path("corpora"))


def test_humaneval_scores_canonical_and_broken_solutions() -> None:
    task = load_task("humaneval")
    docs = build_docs(task, _roots(), limit=2, seed=5)
    scorer = get_scorer("humaneval", "code_exec")
    options = json.loads(json.dumps(task.scorer.options))
    for doc in docs:
        good = scorer.score(doc, {"texts": [doc.record["canonical_solution"]]}, options)
        assert [(s.metric, s.score) for s in good] == [("pass@1", 1.0)]
        bad = scorer.score(doc, {"texts": ["    return None\n"]}, options)
        assert bad[0].score == 0.0


def test_humaneval_refuses_to_score_without_a_sandbox(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORGE_SANDBOX_BWRAP", "/nonexistent/bwrap")
    task = load_task("humaneval")
    doc = build_docs(task, _roots(), limit=1, seed=5)[0]
    options = json.loads(json.dumps(task.scorer.options))
    with pytest.raises(SandboxUnavailableError, match="bubblewrap '/nonexistent/bwrap' is missing"):
        get_scorer("humaneval", "code_exec").score(
            doc, {"texts": [doc.record["canonical_solution"]]}, options
        )
