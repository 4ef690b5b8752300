"""Small multiple-choice benchmarks written by the tests: a TruthfulQA-style set (MC1 with one
true answer, MC2 with several) and an ARC-style set (3 to 5 lettered choices), in the records'
upstream shapes, with minus signs, accents, emoji and CJK so byte-level tokens split characters.
Each is a Forge task from YAML alone and the same task as lm-evaluation-harness writes it."""

from __future__ import annotations

import json
from pathlib import Path

TRUTHFUL = [
    (
        "What is 5 \u2212 7?",
        ["\u22122", "2", "12", "\u221212"],
        [1, 0, 0, 0],
        ["\u22122", "minus two", "2", "12"],
        [1, 1, 0, 0],
    ),
    (
        "Where is the Caf\u00e9 de Flore?",
        ["Paris", "Berlin", "Z\u00fcrich"],
        [1, 0, 0],
        ["In Paris", "On the Left Bank", "In Berlin"],
        [1, 1, 0],
    ),
    (
        "Which emoji means yes?",
        ["\U0001f44d", "\U0001f44e", "\U0001f600\U0001f600"],
        [1, 0, 0],
        ["\U0001f44d", "thumbs up", "\U0001f44e"],
        [1, 1, 0],
    ),
    (
        "\u4e2d\u6587\u662f\u4ec0\u4e48\uff1f",
        ["\u4e00\u79cd\u8bed\u8a00", "a fish", "\u65e5\u672c\u8a9e"],
        [1, 0, 0],
        ["\u4e00\u79cd\u8bed\u8a00", "Chinese", "a fish", "a river"],
        [1, 1, 0, 0],
    ),
    (
        "To be, or not to be?",
        ["that is the question", "no", "na\u00efve r\u00e9sum\u00e9"],
        [1, 0, 0],
        ["that is the question", "Hamlet asks it", "no"],
        [1, 1, 0],
    ),
    (
        "How cold is \u221240\u00b0?",
        ["as cold in \u00b0F", "warm", "hot"],
        [1, 0, 0],
        ["as cold in \u00b0F", "very cold", "warm"],
        [1, 1, 0],
    ),
]

ARC = [
    ("Which is a noble gas?", ["Neon", "Iron", "Sodium", "Carbon"], "A"),
    ("What does \u2212 mean in 9 \u2212 4?", ["add", "subtract", "multiply"], "B"),
    ("Pick the accented word.", ["cafe", "resume", "na\u00efve", "apple", "stone"], "C"),
    ("\u6c34\u7684\u5316\u5b66\u5f0f\u662f\u4ec0\u4e48\uff1f", ["CO2", "NaCl", "H2O", "O2"], "C"),
    ("Which one smiles?", ["\U0001f600", "\U0001f610", "\U0001f622"], "A"),
    ("My lord, what is the time?", ["noon", "the king", "a sword", "the sea"], "A"),
]


QA = [
    ("To be, or not", "to be"),
    ("What is 5 \u2212 7?", "\u22122"),
    ("Caf\u00e9 or tea?", "tea"),
    ("\u4e2d\u6587\u662f\u4ec0\u4e48\uff1f", "\u8bed\u8a00"),
    ("My lord, the king", "is dead"),
]


def write_data(folder: Path) -> dict[str, Path]:
    """The JSONL files under ``folder``: ``truthful``, ``arc`` and ``qa`` (generative)."""
    folder.mkdir(parents=True, exist_ok=True)
    qa = folder / "qa.jsonl"
    qa.write_text("".join(json.dumps({"q": q, "a": a}, ensure_ascii=False) + "\n" for q, a in QA))
    truthful = folder / "truthful.jsonl"
    truthful.write_text(
        "".join(
            json.dumps(
                {
                    "question": q,
                    "mc1_targets": {"choices": c1, "labels": l1},
                    "mc2_targets": {"choices": c2, "labels": l2},
                },
                ensure_ascii=False,
            )
            + "\n"
            for q, c1, l1, c2, l2 in TRUTHFUL
        )
    )
    arc = folder / "arc.jsonl"
    arc.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"arc-{i}",
                    "question": q,
                    "choices": {"text": texts, "label": list("ABCDE"[: len(texts)])},
                    "answerKey": key,
                },
                ensure_ascii=False,
            )
            + "\n"
            for i, (q, texts, key) in enumerate(ARC)
        )
    )
    return {"truthful": truthful, "arc": arc, "qa": qa}


def write_forge_tasks(folder: Path) -> dict[str, Path]:
    """Forge tasks over ``<benchmarks>/mc/*.jsonl``: YAML only, per-example choices."""
    common = "output_type: multiple_choice\n"
    tasks = {
        "t_mc1": common
        + "dataset: {path: mc/truthful.jsonl}\n"
        + "template:\n  prompt: \"Q: {{ question }}\\nA:\"\n  choices: '{{ mc1_targets.choices }}'\n"
        + "  delimiter: ' '\n  gold: '0'\n"
        + "scorer: {name: multiple_choice_loglikelihood}\n",
        "t_mc2": common
        + "dataset: {path: mc/truthful.jsonl}\n"
        + "template:\n  prompt: \"Q: {{ question }}\\nA:\"\n  choices: '{{ mc2_targets.choices }}'\n"
        + "  delimiter: ' '\n"
        + "  gold: '[{% for l in mc2_targets.labels %}{% if l %}{{ loop.index0 }},{% endif %}{% endfor %}]'\n"
        + "scorer: {name: multiple_choice_mc2}\n",
        "t_arc": common
        + "dataset: {path: mc/arc.jsonl}\n"
        + "template:\n  id: '{{ id }}'\n  prompt: \"Question: {{ question }}\\nAnswer:\"\n"
        + "  choices: '{{ choices.text }}'\n  delimiter: ' '\n"
        + "  gold: '{{ choices.label.index(answerKey) }}'\n"
        + "scorer: {name: multiple_choice_loglikelihood}\n",
    }
    tasks["t_chat"] = (
        "output_type: generate_until\nchat: true\ndataset: {path: mc/qa.jsonl}\n"
        + "template: {prompt: '{{ q }}', target: '{{ a }}'}\n"
        + 'generation: {max_tokens: 8, stop: ["\\n"]}\n'
        + "scorer: {name: regex_match, options: {regex: '(\\S+)'}}\n"
    )
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, body in tasks.items():
        out[name] = folder / f"{name}.yaml"
        out[name].write_text(f"name: {name}\n{body}")
    return out


LM_EVAL_MC2 = '''import numpy as np


def process_results_mc2(doc, results):
    """lm-evaluation-harness's truthfulqa_mc2: the true answers come first in mc2_targets."""
    lls, _ = zip(*results)
    split = list(doc["mc2_targets"]["labels"]).index(0)
    p_true = np.exp(np.array(lls[:split]))
    p_false = np.exp(np.array(lls[split:]))
    return {"acc": float(sum(p_true / (sum(p_true) + sum(p_false))))}
'''


def write_lm_eval_tasks(folder: Path, data: dict[str, Path]) -> list[str]:
    """The same three tasks as lm-evaluation-harness YAML (its TruthfulQA and ARC configs' shape)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "mc_utils.py").write_text(LM_EVAL_MC2)

    def dataset(path: Path) -> str:
        return f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\n"

    specs = {
        "l_mc1": dataset(data["truthful"])
        + 'output_type: multiple_choice\ndoc_to_text: "Q: {{question}}\\nA:"\ndoc_to_target: 0\n'
        + 'doc_to_choice: "{{mc1_targets.choices}}"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n',
        "l_mc2": dataset(data["truthful"])
        + 'output_type: multiple_choice\ndoc_to_text: "Q: {{question}}\\nA:"\ndoc_to_target: 0\n'
        + 'doc_to_choice: "{{mc2_targets.choices}}"\nprocess_results: !function mc_utils.process_results_mc2\n'
        + "metric_list:\n  - metric: acc\n",
        "l_arc": dataset(data["arc"])
        + 'output_type: multiple_choice\ndoc_to_text: "Question: {{question}}\\nAnswer:"\n'
        + 'doc_to_target: "{{choices.label.index(answerKey)}}"\ndoc_to_choice: "{{choices.text}}"\n'
        + "metric_list:\n  - metric: acc\n  - metric: acc_norm\n",
    }
    for name, body in specs.items():
        (folder / f"{name}.yaml").write_text(f"task: {name}\n{body}")
    return list(specs)


def write_lm_eval_chat_task(folder: Path, data: dict[str, Path]) -> str:
    """The generative ``t_chat`` task as lm-evaluation-harness YAML (sent as chat messages)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "l_chat.yaml").write_text(
        "task: l_chat\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data['qa']}\ntest_split: test\noutput_type: generate_until\n"
        "doc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
        'generation_kwargs: {until: ["\\n"], max_gen_toks: 8, do_sample: false, temperature: 0}\n'
        "metric_list:\n  - metric: exact_match\n"
    )
    return "l_chat"
