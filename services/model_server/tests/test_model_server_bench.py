"""``forge bench engine`` on a tiny workload: the contract's keys, and the engine's tokens equal
one-at-a-time ``generate`` on the same weights."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from forge_model_server.bench import app

SMALL = ["--num-requests", "5", "--min-prompt", "3", "--max-prompt", "40", "--min-output", "2"]
SMALL += ["--max-output", "9", "--hf-batch-size", "2", "--max-num-batched-tokens", "16"]


def test_engine_bench_writes_the_contract_summary(tmp_path: Path, tiny_llama: Path) -> None:
    result = CliRunner().invoke(
        app, ["engine", "--out", str(tmp_path / "out"), "--model-dir", str(tiny_llama), *SMALL]
    )
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    for key in ("engine_tok_s", "hf_static_tok_s", "sequential_tok_s"):
        assert summary[key] > 0
    assert summary["engine_vs_hf_static"] == summary["engine_tok_s"] / summary["hf_static_tok_s"]
    assert summary["engine_vs_sequential"] == summary["engine_tok_s"] / summary["sequential_tok_s"]
    cpu = summary["cpu_s"]
    assert summary["engine_vs_hf_static_cpu"] == cpu["hf_static"] / cpu["engine"] > 0
    assert summary["engine_vs_sequential_cpu"] == cpu["sequential"] / cpu["engine"] > 0
    # Chunked prefill (a 16-token budget), batching and the paged cache change no greedy token.
    assert summary["identical_to_sequential"] == 5 and summary["threads"] == 1
    assert 5 * 2 <= summary["output_tokens"] <= 5 * 9


def test_bad_options_name_the_option(tmp_path: Path, tiny_llama: Path) -> None:
    runner = CliRunner()
    reply = runner.invoke(app, ["engine", "--out", str(tmp_path), "--num-requests", "0"])
    assert reply.exit_code == 2 and "--num-requests" in reply.output
    reply = runner.invoke(app, ["engine", "--out", str(tmp_path), "--model-dir", str(tmp_path)])
    assert reply.exit_code == 2 and "--model-dir" in reply.output and "config.json" in reply.output
    reply = runner.invoke(
        app, ["engine", "--out", str(tmp_path), "--model-dir", str(tiny_llama), "--max-prompt", "300"]
    )
    assert reply.exit_code == 2 and "--max-prompt" in reply.output and "context is 256" in reply.output
