"""Write ``libs/kit/src/forge_kit/datasets.json``: every file of every dataset the platform uses,
with the public address it comes from and the sha256 and size it must have.

    .venv/bin/python scripts/data_manifest.py MIRROR_DIR

The addresses are written down here, by hand, from each dataset's provenance; the checksums and
sizes are read from a mirror holding the same bytes (``forge data fetch`` then refuses anything
else). Rerun it when a dataset is added or a source moves.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "libs" / "kit" / "src" / "forge_kit" / "datasets.json"

GH = "https://raw.githubusercontent.com"
BEIR = "https://public.ukp.informatik.tu-darmstadt.de/thakur/BEIR/datasets"
MMLU = f"{GH}/hendrycks/test/785eba57b455b9f9be12a0d3c1106d67274fea0e"
BBH = f"{GH}/suzgunmirac/BIG-Bench-Hard/main"

# name -> (folder under the data dir, description, license, how each file is found)
# A source is either {"url": template} ({rel} is the path inside the folder, {stem} its file name
# without suffix) or {"archive": url, "member": template} for files inside a zip.
DATASETS: dict[str, dict[str, object]] = {
    "tinyshakespeare": {
        "folder": "corpora/tinyshakespeare",
        "description": "1.1 MB of Shakespeare (karpathy/char-rnn): tokenizer and pre-training corpus",
        "license": "public domain text",
        "sources": {"input.txt": {"url": f"{GH}/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"}},
    },
    "gsm8k": {
        "folder": "benchmarks/gsm8k",
        "description": "GSM8K grade-school maths (openai/grade-school-math)",
        "license": "MIT",
        "sources": {
            "LICENSE": {"url": f"{GH}/openai/grade-school-math/master/LICENSE"},
            "*.jsonl": {"url": f"{GH}/openai/grade-school-math/master/grade_school_math/data/{{rel}}"},
        },
    },
    "humaneval": {
        "folder": "benchmarks/humaneval",
        "description": "HumanEval code generation (openai/human-eval)",
        "license": "MIT",
        "sources": {
            "LICENSE": {"url": f"{GH}/openai/human-eval/master/LICENSE"},
            "HumanEval.jsonl.gz": {"url": f"{GH}/openai/human-eval/master/data/HumanEval.jsonl.gz"},
        },
    },
    "mmlu": {
        "folder": "benchmarks/mmlu",
        "description": "MMLU, the 2020 CSV snapshot (hendrycks/test @ 785eba5)",
        "license": "MIT",
        "sources": {
            "LICENSE": {"url": f"{MMLU}/LICENSE"},
            "*/*.csv": {"url": f"{MMLU}/data/{{rel}}"},
        },
    },
    "bbh": {
        "folder": "benchmarks/bbh",
        "description": "BIG-Bench Hard tasks and chain-of-thought prompts (suzgunmirac/BIG-Bench-Hard)",
        "license": "MIT",
        "sources": {
            "LICENSE": {"url": f"{BBH}/LICENSE"},
            "cot-prompts/*.txt": {"url": f"{BBH}/{{rel}}"},
            "*.json": {"url": f"{BBH}/bbh/{{rel}}"},
        },
    },
    "hh-rlhf": {
        "folder": "preferences/hh-rlhf",
        "description": "Anthropic HH-RLHF test comparisons (harmless-base, helpful-base)",
        "license": "MIT",
        "sources": {
            "LICENSE": {"url": "https://github.com/anthropics/hh-rlhf/raw/master/LICENSE"},
            "*/test.jsonl.gz": {"url": "https://github.com/anthropics/hh-rlhf/raw/master/{rel}"},
        },
    },
    "nfcorpus": {
        "folder": "beir/nfcorpus",
        "description": "BEIR NFCorpus (official zip, unmodified)",
        "license": "see the BEIR project",
        "sources": {"**": {"archive": f"{BEIR}/nfcorpus.zip", "member": "nfcorpus/{rel}"}},
    },
    "scifact": {
        "folder": "beir/scifact",
        "description": "BEIR SciFact; corpus.jsonl is rebuilt from allenai/scifact and differs from BEIR's zip "
        "in a few bytes, so it comes from a mirror only",
        "license": "CC BY-NC 2.0",
        "sources": {
            "corpus.jsonl": {},
            "**": {"archive": f"{BEIR}/scifact.zip", "member": "scifact/{rel}"},
        },
    },
    "philly": {
        "folder": "traces/philly_pollux",
        "description": "Microsoft Philly 2017 job trace as processed by the Pollux artifact (petuum/adaptdl)",
        "license": "CC BY 4.0",
        "sources": {
            "philly.csv": {
                "url": f"{GH}/petuum/adaptdl/c793c7089bd307462686339d29707925c461f9a9/simulator/traces/philly.csv"
            }
        },
    },
    "openb": {
        "folder": "traces/alibaba_openb_2023",
        "description": "Alibaba openb GPU-sharing pods and nodes (alibaba/clusterdata, FGD paper)",
        "license": "see alibaba/clusterdata",
        "sources": {
            "openb_*.csv": {
                "url": f"{GH}/alibaba/clusterdata/7a6c496e4f4b6ce6150be8f881cb051bf2abff42/"
                "cluster-trace-gpu-v2023/csv/{rel}"
            }
        },
    },
    "acme": {
        "folder": "traces/acme_cluster_summary",
        "description": "Production statistics of four GPU clusters (InternLM/AcmeTrace)",
        "license": "CC BY 4.0",
        "sources": {
            "cluster_summary.csv": {
                "url": f"{GH}/InternLM/AcmeTrace/6d6ac9cd15f3b01151ac6ba00ecddd9156f0dc73/data/cluster_summary.csv"
            }
        },
    },
}


def _source(sources: dict[str, dict[str, str]], rel: str) -> dict[str, str] | None:
    """The first source whose pattern matches ``rel`` (``**`` matches anything), formatted."""
    for pattern, source in sources.items():
        if pattern == "**" or Path(rel).match(pattern):
            stem = Path(rel).name.split(".")[0]
            return {k: v.format(rel=rel, stem=stem) for k, v in source.items()}
    return None


def build(mirror: Path) -> dict[str, object]:
    datasets: dict[str, object] = {}
    for name, spec in DATASETS.items():
        folder = mirror / str(spec["folder"])
        sources = spec["sources"]
        assert isinstance(sources, dict)
        files = []
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            rel = path.relative_to(folder).as_posix()
            source = _source(sources, rel)
            if source is None:
                continue  # notes of the mirror's own (README, SOURCE_COMMIT): not part of the data
            data = path.read_bytes()
            files.append(
                {"path": rel, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(), **source}
            )
        if not files:
            raise SystemExit(f"{name}: nothing found under {folder}")
        datasets[name] = {k: v for k, v in spec.items() if k != "sources"} | {"files": files}
    return {"version": 1, "datasets": datasets}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    OUT.write_text(json.dumps(build(Path(sys.argv[1])), indent=1) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}")
