"""``forge eval`` against the platform's real model server on text that byte-level tokens split
inside characters (minus signs, accents, emoji, CJK), with tasks whose choices vary per example
(TruthfulQA-style MC1 and MC2, ARC-style), written as YAML alone:

- every log-likelihood equals ``transformers``' own, computed directly (to 1e-4);
- lm-evaluation-harness's ``local-completions`` with its default settings (token-id prompts with
  ``echo`` and ``logprobs``, its remote tokenizer found through ``/tokenizer_info``) runs against
  the same server and agrees with ``forge eval`` example by example: the same log-likelihoods,
  ``acc``, ``acc_norm`` and MC2 mass.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mc_fixtures import write_data, write_forge_tasks, write_lm_eval_tasks
from tiny_checkpoint import make_tiny_checkpoint

from forge_eval.backend import Continuation, OpenAIBackend
from forge_eval.harness import run_task
from forge_eval.tasks import DataRoots, load_task
from forge_kit.testing import ServiceProcess

pytestmark = pytest.mark.integration

TOKEN = "agreement-token"


@dataclass(frozen=True)
class Served:
    root: Path
    model_dir: Path
    url: str


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("agreement")
    model_dir = make_tiny_checkpoint(root / "models" / "tiny", context=256)
    write_data(root / "benchmarks" / "mc")
    server = ServiceProcess(
        "forge_model_server",
        env={
            "FORGE_MODEL_SERVER_GRPC_PORT": "0",
            "FORGE_MODEL_SERVER_HTTP_PORT": "0",
            "FORGE_MODEL_SERVER_AUTH_TOKEN": TOKEN,
            "FORGE_MODEL_SERVER_MODELS_DIR": str(root / "models"),
            "FORGE_MODEL_SERVER_KAFKA_ENABLED": "false",
            "FORGE_MODEL_SERVER_TORCH_THREADS": "1",
        },
        cwd=str(root),
        log_path=str(root / "model_server.log"),
    ).start(90)
    try:
        yield Served(root, model_dir, server.http_url)
    finally:
        server.stop()


async def forge_samples(served: Served) -> dict[str, list[dict[str, Any]]]:
    tasks = write_forge_tasks(served.root / "tasks")
    roots = DataRoots(served.root / "benchmarks", served.root / "corpora")
    backend = OpenAIBackend(served.url, "tiny", token=TOKEN)
    try:
        identity = await backend.identity()
        return {
            name: (await run_task(load_task(str(path)), roots, backend, identity)).samples
            for name, path in tasks.items()
        }
    finally:
        await backend.aclose()


def transformers_loglikelihood(model: Any, tokenizer: Any, context: str, continuation: str) -> float:
    """log p(continuation | context) by ``transformers`` directly, split as lm-eval splits it."""
    import torch

    pair = Continuation.split(context, continuation)
    context_ids = tokenizer.encode(pair.context, add_special_tokens=False)
    whole = tokenizer.encode(pair.context + pair.continuation, add_special_tokens=False)
    ids = context_ids + whole[len(context_ids) :]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    return float(sum(logp[i - 1, ids[i]] for i in range(len(context_ids), len(ids))))


async def test_every_loglikelihood_equals_transformers(served: Served) -> None:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(served.model_dir))
    model = LlamaForCausalLM.from_pretrained(served.model_dir).eval()
    samples = await forge_samples(served)
    compared = equal = 0
    for task, rows in samples.items():
        for sample in rows:
            for choice, got in zip(sample["choices"], sample["response"]["choices"], strict=True):
                want = transformers_loglikelihood(model, tokenizer, sample["prompt"], " " + choice)
                compared += 1
                equal += abs(got["logprob"] - want) <= 1e-4
                assert got["logprob"] == pytest.approx(want, abs=1e-4), (task, sample["id"], choice)
    print(f"forge eval vs transformers: {equal} of {compared} log-likelihoods equal within 1e-4")
    assert compared == sum(len(r["choices"]) for rows in samples.values() for r in rows) > 50


async def test_lm_eval_local_completions_with_defaults_agrees_with_forge_eval(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("OPENAI_API_KEY", TOKEN)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(served.root / "hf-datasets"))
    names = write_lm_eval_tasks(served.root / "lm_eval_tasks", write_data(served.root / "lm_eval_data"))
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": "tiny", "base_url": f"{served.url}/v1/completions", "auth_token": TOKEN},
        tasks=names,
        task_manager=TaskManager(include_path=str(served.root / "lm_eval_tasks")),
        log_samples=True,
    )
    assert results is not None
    theirs = {name: sorted(results["samples"][name], key=lambda s: s["doc_id"]) for name in names}
    ours = await forge_samples(served)
    compared = equal = 0
    for forge_name, lm_name, metrics in (
        ("t_mc1", "l_mc1", {"acc": "acc", "acc_norm": "acc_norm"}),
        ("t_mc2", "l_mc2", {"mc2": "acc"}),
        ("t_arc", "l_arc", {"acc": "acc", "acc_norm": "acc_norm"}),
    ):
        assert len(ours[forge_name]) == len(theirs[lm_name])
        for mine, other in zip(ours[forge_name], theirs[lm_name], strict=True):
            lls = [float(r[0]) for r in other["filtered_resps"]]
            got = [c["logprob"] for c in mine["response"]["choices"]]
            compared += len(lls)
            equal += sum(abs(a - b) <= 1e-6 for a, b in zip(got, lls, strict=True))
            assert got == pytest.approx(lls, abs=1e-4), (forge_name, mine["id"])
            for ours_metric, their_metric in metrics.items():
                assert mine["scores"][ours_metric] == pytest.approx(float(other[their_metric]), abs=1e-6)
    print(f"forge eval vs lm-eval local-completions: {equal} of {compared} log-likelihoods equal (1e-6)")
