"""``forge eval`` against the platform's real model server on text that byte-level tokens split
inside characters (minus signs, accents, emoji, CJK), with tasks whose choices vary per example
(TruthfulQA-style MC1 and MC2, ARC-style), written as YAML alone:

- every log-likelihood equals ``transformers``' own, computed directly (to 1e-4);
- lm-evaluation-harness's ``local-completions`` with its default settings (token-id prompts with
  ``echo`` and ``logprobs``, its remote tokenizer found through ``/tokenizer_info``) runs against
  the same server — the model server itself, and the inference gateway in front of it — and
  agrees with ``forge eval`` example by example: the same log-likelihoods, ``acc``, ``acc_norm``
  and MC2 mass.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from mc_fixtures import write_data, write_forge_tasks, write_lm_eval_chat_task, write_lm_eval_tasks
from tiny_checkpoint import make_tiny_checkpoint

from forge_eval.backend import Continuation, OpenAIBackend
from forge_eval.harness import run_task
from forge_eval.tasks import DataRoots, load_task
from forge_kit.testing import ServiceProcess, base_env

pytestmark = pytest.mark.integration

TOKEN = "agreement-token"


GATEWAY_KEY = "agreement-tenant-key"


@dataclass(frozen=True)
class Served:
    root: Path
    model_dir: Path
    url: str
    gateway_url: str = ""

    def endpoint(self, name: str) -> tuple[str, str]:
        """The base URL and bearer token of ``model_server`` or ``gateway``."""
        return (self.url, TOKEN) if name == "model_server" else (self.gateway_url, GATEWAY_KEY)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("agreement")
    model_dir = make_tiny_checkpoint(root / "models" / "tiny", context=256)
    write_data(root / "benchmarks" / "mc")
    server = ServiceProcess(
        "forge_model_server",
        env=base_env("model_server", token=TOKEN, models_dir=str(root / "models"), torch_threads="1"),
        cwd=str(root),
        log_path=str(root / "model_server.log"),
    ).start(90)
    gateway = ServiceProcess(
        "forge_inference_gateway",
        env=base_env(
            "inference_gateway",
            token="agreement-admin",
            data_dir=root / "gateway",
            model_server_url=server.http_url,
            model_server_token=TOKEN,
            bootstrap_api_key=GATEWAY_KEY,
        ),
        cwd=str(root),
        log_path=str(root / "gateway.log"),
    )
    try:
        gateway.start(90)
        yield Served(root, model_dir, server.http_url, gateway.http_url)
    finally:
        gateway.stop()
        server.stop()


async def forge_samples(served: Served, endpoint: str = "model_server") -> dict[str, list[dict[str, Any]]]:
    tasks = write_forge_tasks(served.root / "tasks")
    roots = DataRoots(served.root / "benchmarks", served.root / "corpora")
    url, token = served.endpoint(endpoint)
    backend = OpenAIBackend(url, "tiny", token=token)
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
            if not sample["choices"]:
                continue  # the generative task
            for choice, got in zip(sample["choices"], sample["response"]["choices"], strict=True):
                want = transformers_loglikelihood(model, tokenizer, sample["prompt"], " " + choice)
                compared += 1
                equal += abs(got["logprob"] - want) <= 1e-4
                assert got["logprob"] == pytest.approx(want, abs=1e-4), (task, sample["id"], choice)
    print(f"forge eval vs transformers: {equal} of {compared} log-likelihoods equal within 1e-4")
    assert compared == sum(len(r["choices"]) for rows in samples.values() for r in rows) > 50


def test_a_served_name_gives_harnesses_its_tokenizer_and_no_host_path(served: Served) -> None:
    """vLLM's tokenizer routes on both endpoints, without ``model`` (lm-eval's remote tokenizer
    sends none): the checkpoint's own ids; nothing shows where the checkpoint lives."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(served.model_dir))
    text = "x \u2212 2 And caf\u00e9 \U0001f600 \u4e2d\u6587"
    for name in ("model_server", "gateway"):
        url, token = served.endpoint(name)
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as http:
            ids = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
            assert ids == tokenizer.encode(text, add_special_tokens=False), name
            assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == text
            info = http.get("/tokenizer_info")
            assert info.status_code == 200 and info.json()["eos_token"] == tokenizer.eos_token
            for shown in (info.text, http.get("/v1/models").text):
                assert str(served.root) not in shown and "/tmp" not in shown, name
            refused = http.post("/detokenize", json={"tokens": "nope"})
            assert refused.status_code == 400 and refused.json()["error"]["param"].startswith("tokens")


def offline(monkeypatch: pytest.MonkeyPatch, served: Served, token: str) -> None:
    """lm-eval's key (its API models read OPENAI_API_KEY) and datasets read from local files."""
    monkeypatch.setenv("OPENAI_API_KEY", token)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(served.root / "hf-datasets"))


@pytest.mark.parametrize("endpoint", ["model_server", "gateway"])
async def test_lm_eval_local_completions_with_defaults_agrees_with_forge_eval(
    served: Served, monkeypatch: pytest.MonkeyPatch, endpoint: str
) -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager

    url, token = served.endpoint(endpoint)
    offline(monkeypatch, served, token)
    names = write_lm_eval_tasks(served.root / "lm_eval_tasks", write_data(served.root / "lm_eval_data"))
    results = lm_eval.simple_evaluate(
        model="local-completions",
        # Defaults otherwise: token-id prompts, and the tokenizer found at /tokenizer_info (no
        # tokenizer is named: a hub name would not resolve here, offline).
        model_args={"model": "tiny", "base_url": f"{url}/v1/completions", "auth_token": token},
        tasks=names,
        task_manager=TaskManager(include_path=str(served.root / "lm_eval_tasks")),
        log_samples=True,
    )
    assert results is not None
    theirs = {name: sorted(results["samples"][name], key=lambda s: s["doc_id"]) for name in names}
    ours = await forge_samples(served, endpoint)
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
    print(
        f"{endpoint}: forge eval vs lm-eval local-completions: {equal} of {compared} log-likelihoods equal (1e-6)"
    )


@pytest.mark.parametrize("endpoint", ["model_server", "gateway"])
async def test_lm_eval_local_chat_completions_agrees_with_forge_eval(
    served: Served, monkeypatch: pytest.MonkeyPatch, endpoint: str
) -> None:
    """A generative task sent as chat (lm-eval's ``local-chat-completions``, which needs its
    ``apply_chat_template``): the same greedy answers as ``forge eval``'s chat task."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    url, token = served.endpoint(endpoint)
    offline(monkeypatch, served, token)
    folder = served.root / "lm_eval_chat"
    name = write_lm_eval_chat_task(folder, write_data(served.root / "lm_eval_data"))
    results = lm_eval.simple_evaluate(
        model="local-chat-completions",
        model_args={"model": "tiny", "base_url": f"{url}/v1/chat/completions"},
        tasks=[name],
        task_manager=TaskManager(include_path=str(folder)),
        apply_chat_template=True,
        log_samples=True,
    )
    assert results is not None
    theirs = sorted(results["samples"][name], key=lambda s: s["doc_id"])
    ours = (await forge_samples(served, endpoint))["t_chat"]
    assert [s["response"]["texts"][0] for s in ours] == [s["resps"][0][0] for s in theirs]
    assert any(s["response"]["texts"][0] for s in ours)
    print(
        f"{endpoint}: forge eval vs lm-eval local-chat-completions: {len(ours)} of {len(theirs)} answers equal"
    )
