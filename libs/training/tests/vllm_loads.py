"""Run by vLLM's interpreter (``.venv-vllm``), not by Forge's: load model folders one after the
other in one process with vLLM's ``LLM`` class, and print what vLLM made of each as one JSON line.

``python vllm_loads.py PLAN.json`` where the plan is ``{"engine": {LLM keyword arguments},
"models": [{"name", "path", "kind": "chat" | "classify", "engine"?, ...}]}`` (a model's own
``engine`` arguments override the plan's):

- ``chat``: ``messages`` (OpenAI-style, ``image_url`` parts included) and ``max_tokens``; a
  greedy ``LLM.chat`` with the folder's own chat template; the line holds the prompt's token ids
  as vLLM rendered and encoded them, the generated ids, their log-probabilities and the text,
  the finish reason, and the generation config vLLM read;
- ``classify``: ``texts``; ``LLM.classify`` (the pooling runner); the line holds each text's
  token ids and its raw logits.

A folder vLLM cannot load gives a line with ``error`` and the next is tried. The engine of each
runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so one interpreter start and one
import serve every model; each is torn down before the next loads.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm import LLM, PoolingParams, SamplingParams
from vllm.distributed.parallel_state import cleanup_dist_env_and_memory


def chat(llm: LLM, spec: dict[str, Any]) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=0)
    (out,) = llm.chat(spec["messages"], params, use_tqdm=False)
    (choice,) = out.outputs
    return {
        "prompt_token_ids": list(out.prompt_token_ids or []),
        "token_ids": list(choice.token_ids),
        "text": choice.text,
        "logprobs": [
            step[token].logprob for step, token in zip(choice.logprobs or [], choice.token_ids, strict=True)
        ],
        "finish_reason": choice.finish_reason,
        "generation_config": llm.model_config.try_get_generation_config(),
        "eos_token_id": llm.get_tokenizer().eos_token_id,
    }


def classify(llm: LLM, spec: dict[str, Any]) -> dict[str, Any]:
    # The raw logits: a one-label head's score as the model gives it, no sigmoid.
    outs = llm.classify(spec["texts"], pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    return {
        "prompt_token_ids": [list(o.prompt_token_ids) for o in outs],
        "outputs": [[float(x) for x in o.outputs.probs] for o in outs],
    }


def main(plan_path: str) -> int:
    with open(plan_path, encoding="utf-8") as handle:
        plan = json.load(handle)
    for spec in plan["models"]:
        started = time.monotonic()
        line: dict[str, Any] = {"name": spec["name"]}
        llm = None
        try:
            runner = "pooling" if spec["kind"] == "classify" else "generate"
            llm = LLM(model=spec["path"], runner=runner, **{**plan["engine"], **spec.get("engine", {})})
            line["load_s"] = round(time.monotonic() - started, 1)
            line.update(chat(llm, spec) if spec["kind"] == "chat" else classify(llm, spec))
        except Exception as exc:  # noqa: BLE001 — one folder's failure is that folder's line
            line["error"] = f"{type(exc).__name__}: {exc}"
            line["traceback"] = traceback.format_exc()[-4000:]
        finally:
            del llm
            gc.collect()
            cleanup_dist_env_and_memory()
        print("VLLM_LOAD " + json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
