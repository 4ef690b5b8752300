"""Every recipe's export loads in vLLM: each recipe is trained for a step or two from its own
defaults (tiny data, the recipe's model shape) and exported as its runs export, and one vLLM
process (``vllm_loads.py``, in ``.venv-vllm``) loads every export in turn with vLLM's ``LLM``.

- A causal LM (``shakespeare_tiny``, ``smoke``, ``cpt_scifact``, ``sft_hh``, ``dpo_hh``,
  ``vlm_world_lm``) answers a chat: vLLM renders the prompt with the export's own chat template and encodes it with its
  tokenizer to exactly the ids ``transformers`` gives; every token it generates greedily is the
  ``transformers`` model's most likely next one; it reads the export's generation config and
  stops on its end-of-text token.
- A scorer (``reward_hh``'s Llama, ``reward_hh_minilm``'s and ``rerank_beir_minilm``'s BERT) loads
  as a pooling model and gives the logit ``transformers`` gives for the same ids.
- A VLM (``vlm_align``, ``vlm_interleave``, ``vlm_instruct`` over ``vlm_world_lm``, each stage
  over the one before as in the curriculum, and ``vlm_joint``) answers an ``image_url`` chat as
  a LLaVA export in vLLM's Transformers backend (``model_impl="transformers"``: vLLM's own LLaVA
  module imports ``torchvision``, absent from the CPU environment) with the training side's
  prompt ids and the ``transformers`` LLaVA's greedy tokens.

A recipe vLLM cannot serve goes in :data:`NOT_VLLM` with the reason (none today); a new recipe
fails :func:`test_every_recipe_is_loaded_or_says_why_not` until it is in one of the lists.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from forge_kit.objectstore import ObjectStore
from forge_kit.paths import resolve_data_path
from forge_kit.testing.requires import missing
from forge_kit.vllm import server_env, vllm_available, vllm_python
from forge_training import recipes, schema
from forge_training.data import EOT
from forge_training.train import RunContext, train
from forge_training.vlm import world
from forge_training.vlm.dataset import WorldSize, write_world
from forge_training.vlm.images import preprocess
from forge_training.vlm.model import load_vlm
from forge_training.vlm.tokens import SequenceEncoder

#: Recipes whose export vLLM does not serve here, and why.
NOT_VLLM: dict[str, str] = {}
CHAT = ("shakespeare_tiny", "smoke", "cpt_scifact", "sft_hh", "dpo_hh", "vlm_world_lm")
SCORERS = ("reward_hh", "reward_hh_minilm", "rerank_beir_minilm")
#: Short: ``smoke`` is trained on 32-token sequences, and its export's context is that long (its
#: byte-level BPE of 300 pieces makes this prompt 27 tokens).
MESSAGES = [{"role": "user", "content": "What light breaks?"}]
TEXTS = ["Human: is the sun a star?\n\nAssistant: yes, the nearest one", "volcanic ash and sulphur"]
MAX_TOKENS = 12
#: How far below the ``transformers`` model's best next token vLLM's may be (float32 on both
#: sides differs by ~1e-5; a near-tie may go either way).
LOGPROB_SLACK = 1e-3
pytestmark = pytest.mark.timeout(1200)

VLMS = ("vlm_align", "vlm_interleave", "vlm_instruct", "vlm_joint")
VLM_QUESTION = "What colour is the circle?"

#: Overrides that make any recipe a step or two on one thread.
QUICK = {
    "max_steps": "2",
    "eval_interval": "2",
    "eval_batches": "2",
    "log_interval": "1",
    "threads": "1",
    "optim.warmup_steps": "0",
    "checkpoint.interval_steps": "0",
}
PAIRS = {
    "pairs.max_pairs": "24",
    "data.seq_len": "48",
    "global_batch_size": "4",
    "micro_batch_size": "2",
}
#: A BEIR-format folder of six documents and queries, for the reranker's groups.
DOCS = {
    "d1": ("Volcanic gases", "eruptions emit sulphur dioxide and carbon dioxide into the air"),
    "d2": ("Bread", "yeast ferments sugar in dough and the gas makes bread rise"),
    "d3": ("Oceans", "ocean acidity rises as seawater absorbs carbon dioxide"),
    "d4": ("Glaciers", "glaciers melt faster as the climate warms"),
    "d5": ("Coffee", "roasting coffee beans releases carbon dioxide"),
    "d6": ("Wine", "yeast ferments grape sugar into wine"),
}
QUERIES = {
    "q1": ("do eruptions emit sulphur dioxide", "d1"),
    "q2": ("how does yeast make bread rise", "d2"),
    "q3": ("ocean acidity from carbon dioxide", "d3"),
    "q4": ("why do glaciers melt", "d4"),
    "q5": ("coffee roasting and carbon dioxide", "d5"),
    "q6": ("yeast ferments grape sugar", "d6"),
}


def _beir(root: Path) -> Path:
    folder = root / "tiny"
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text(
        "".join(json.dumps({"_id": d, "title": t, "text": x}) + "\n" for d, (t, x) in DOCS.items())
    )
    (folder / "queries.jsonl").write_text(
        "".join(json.dumps({"_id": q, "text": t}) + "\n" for q, (t, _) in QUERIES.items())
    )
    (folder / "qrels" / "train.tsv").write_text(
        "query-id\tcorpus-id\tscore\n" + "".join(f"{q}\t{d}\t1\n" for q, (_, d) in QUERIES.items())
    )
    return root


def _vlm_exports(root: Path) -> dict[str, Path]:
    """``vlm_world_lm``, then each VLM stage over the one before (``vlm_joint`` over the LM), on
    a tiny synthetic world."""
    folder = root / "world"
    write_world(
        folder, 0, WorldSize(captions=24, documents=8, chats=24, text_scenes=100, eval_items=4, per_shard=20)
    )
    small = {"global_batch_size": "4", "micro_batch_size": "2", "eval_batches": "1"}
    out = {"vlm_world_lm": _train(root, "vlm_world_lm", {**small, "data.corpus": str(folder / "text.txt")})}
    over = {"vlm.world": str(folder), "vlm.eval_items": "2", "vlm.max_new_tokens": "2"}
    for recipe, parent in (
        ("vlm_align", "vlm_world_lm"),
        ("vlm_interleave", "vlm_align"),
        ("vlm_instruct", "vlm_interleave"),
        ("vlm_joint", "vlm_world_lm"),
    ):
        out[recipe] = _train(root, recipe, {**small, **over, "init.parent": str(out[parent])})
    return out


def _vlm_messages(image: bytes) -> list[dict[str, Any]]:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": VLM_QUESTION},
            ],
        }
    ]


def _scene_png() -> bytes:
    return world.png(world.render(world.scenes(1, 4)[0], 32))


def _train(root: Path, recipe: str, overrides: dict[str, str]) -> Path:
    config = recipes.build(recipe, {**QUICK, **overrides})
    ctx = RunContext(
        run_id=recipe,
        run_dir=root / recipe / "run",
        store=ObjectStore(str(root / recipe / "objects")),
        cache_dir=root / recipe / "cache",
    )
    result = train(config, ctx)
    assert result.outcome == "succeeded" and result.export_dir is not None, recipe
    return result.export_dir


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each recipe vLLM serves, trained two steps from its defaults and exported."""
    if not vllm_available():
        missing("no vLLM environment: `make install` builds .venv-vllm")
    root = tmp_path_factory.mktemp("recipes")
    general = root / "shakespeare.txt"
    general.write_text(resolve_data_path(schema.DEFAULT_CORPUS).read_text(encoding="utf-8")[:40_000])
    domain = root / "scifact.jsonl"
    with open(resolve_data_path(schema.SCIFACT_CORPUS), encoding="utf-8") as handle:
        domain.write_text("".join(next(handle) for _ in range(60)))
    out = {
        "smoke": _train(root, "smoke", {"data.corpus": str(general)}),
        "shakespeare_tiny": _train(root, "shakespeare_tiny", {"data.corpus": str(general)}),
    }
    parent = str(out["smoke"])  # the main job's parent: cpt, sft, reward and dpo start from it
    out["cpt_scifact"] = _train(
        root,
        "cpt_scifact",
        {"init.parent": parent, "data.corpus": str(domain), "mixture.general_corpus": str(general)},
    )
    for recipe in ("sft_hh", "dpo_hh", "reward_hh"):
        out[recipe] = _train(root, recipe, {**PAIRS, "init.parent": parent})
    out["reward_hh_minilm"] = _train(
        root, "reward_hh_minilm", {**PAIRS, "data.val_fraction": "0.4", "eval_batches": "4"}
    )
    out["rerank_beir_minilm"] = _train(
        root,
        "rerank_beir_minilm",
        {
            "rerank.root": str(_beir(root / "beir")),
            "rerank.datasets": "tiny",
            "rerank.negatives": "1",
            "rerank.negative_depth": "5",
            "data.val_fraction": "0.34",
            "data.seq_len": "32",
            "global_batch_size": "2",
            "micro_batch_size": "1",
        },
    )
    out |= _vlm_exports(root)
    return out


@pytest.fixture(scope="module")
def loaded(exports: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """What vLLM made of each export: one process loads them all, one after the other."""
    root = tmp_path_factory.mktemp("vllm")
    models = [
        {"name": n, "path": str(exports[n]), "kind": "chat", "messages": MESSAGES, "max_tokens": MAX_TOKENS}
        for n in CHAT
    ] + [{"name": n, "path": str(exports[n]), "kind": "classify", "texts": TEXTS} for n in SCORERS]
    models += [
        {
            "name": n,
            "path": str(exports[n]),
            "kind": "chat",
            "messages": _vlm_messages(_scene_png()),
            "max_tokens": MAX_TOKENS,
            "engine": {"model_impl": "transformers"},
        }
        for n in VLMS
    ]
    plan = root / "vllm_plan.json"
    engine = {"dtype": "float32", "max_num_seqs": 2, "seed": 0, "enforce_eager": True}
    plan.write_text(json.dumps({"engine": engine, "models": models}))
    env = server_env(os.environ, threads=1) | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    script = Path(__file__).with_name("vllm_loads.py")
    log = root / "vllm_loads.log"
    with open(log, "w") as stderr:
        done = subprocess.run(
            [str(vllm_python()), str(script), str(plan)],
            env=env,
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            timeout=900,
        )
    lines = [
        json.loads(s.removeprefix("VLLM_LOAD "))
        for s in done.stdout.splitlines()
        if s.startswith("VLLM_LOAD ")
    ]
    if done.returncode != 0 or len(lines) != len(models):
        sys.stderr.write(log.read_text()[-6000:])
    assert done.returncode == 0 and [line["name"] for line in lines] == [m["name"] for m in models]
    return {line["name"]: line for line in lines}


def test_every_recipe_is_loaded_or_says_why_not() -> None:
    assert not set(NOT_VLLM) & {*CHAT, *SCORERS, *VLMS}
    assert {*NOT_VLLM, *CHAT, *SCORERS, *VLMS} == set(recipes.RECIPES)


@pytest.mark.parametrize("recipe", CHAT)
def test_a_causal_export_chats_in_vllm_with_its_tokenizer_template_and_generation_config(
    recipe: str, exports: dict[str, Path], loaded: dict[str, dict[str, Any]]
) -> None:
    export, answer = exports[recipe], loaded[recipe]
    assert "error" not in answer, answer.get("traceback")
    tokenizer = AutoTokenizer.from_pretrained(export)
    eot = tokenizer.convert_tokens_to_ids(EOT)
    # The chat template and the tokenizer travel in the export: the same prompt ids as transformers.
    prompt = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert answer["prompt_token_ids"] == list(prompt)
    # The generation config vLLM read is the export's, and its end of text is the tokenizer's.
    written = json.loads((export / "generation_config.json").read_text())
    assert answer["generation_config"]["eos_token_id"] == written["eos_token_id"] == eot
    assert answer["eos_token_id"] == eot
    # Each generated token is the transformers model's greedy choice (up to a float32 near-tie).
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    generated = answer["token_ids"]
    with torch.no_grad():
        for i, token in enumerate(generated):
            logits = model(torch.tensor([answer["prompt_token_ids"] + generated[:i]])).logits[0, -1]
            logp = torch.log_softmax(logits.double(), -1)
            assert float(logp[token]) >= float(logp.max()) - LOGPROB_SLACK, (recipe, i, token)
    # It stops on the end of text, and nowhere else before max_tokens or the end of the context
    # (the export's max_position_embeddings: the recipe's data.seq_len).
    assert eot not in generated[:-1]
    if answer["finish_reason"] == "stop":
        assert generated[-1] == eot
    else:
        context = json.loads((export / "config.json").read_text())["max_position_embeddings"]
        assert answer["finish_reason"] == "length"
        assert len(generated) == min(MAX_TOKENS, context - len(prompt))
    assert answer["text"] == tokenizer.decode(generated, skip_special_tokens=True)


@pytest.mark.parametrize("recipe", SCORERS)
def test_a_scorer_export_loads_in_vllm_and_scores_as_transformers_does(
    recipe: str, exports: dict[str, Path], loaded: dict[str, dict[str, Any]]
) -> None:
    export, answer = exports[recipe], loaded[recipe]
    assert "error" not in answer, answer.get("traceback")
    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForSequenceClassification.from_pretrained(export, dtype=torch.float32).eval()
    for text, ids, scores in zip(TEXTS, answer["prompt_token_ids"], answer["outputs"], strict=True):
        assert ids == tokenizer(text)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        assert scores == pytest.approx(logits.tolist(), abs=1e-4), (recipe, text)


@pytest.mark.parametrize("recipe", VLMS)
def test_a_vlm_export_answers_an_image_chat_in_vllm_as_transformers_does(
    recipe: str, exports: dict[str, Path], loaded: dict[str, dict[str, Any]]
) -> None:
    answer = loaded[recipe]
    assert "error" not in answer, answer.get("traceback")
    vlm = load_vlm(exports[recipe])
    # vLLM renders the export's template and expands <image> to one token per patch, as training does.
    ids = SequenceEncoder.of(vlm, 512).prompt_ids(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": VLM_QUESTION}]}]
    )
    assert answer["prompt_token_ids"] == ids
    assert ids.count(vlm.image_token_id) == vlm.image_seq_length
    # Each generated token is the transformers LLaVA's greedy choice given the same pixels, at the
    # log-probability vLLM gave it; the image moves those log-probabilities by more than that.
    pixels = preprocess(_scene_png(), vlm.spec)[None]
    generated = answer["token_ids"]
    assert generated and len(answer["logprobs"]) == len(generated)

    def logp(pixel_values: torch.Tensor, i: int) -> torch.Tensor:
        with torch.no_grad():
            out = vlm.model(input_ids=torch.tensor([ids + generated[:i]]), pixel_values=pixel_values)
        return torch.log_softmax(out.logits[0, -1].double(), -1)

    for i, (token, vllm_logp) in enumerate(zip(generated, answer["logprobs"], strict=True)):
        want = logp(pixels, i)
        assert float(want[token]) >= float(want.max()) - LOGPROB_SLACK, (i, token)
        assert vllm_logp == pytest.approx(float(want[token]), abs=1e-4), (i, token)
    blank = logp(torch.zeros_like(pixels), 0)
    assert abs(float(blank[generated[0]]) - answer["logprobs"][0]) > 1e-3
    assert answer["text"] == vlm.tokenizer.decode(generated, skip_special_tokens=True)
