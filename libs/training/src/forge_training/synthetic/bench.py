"""``forge bench synthetic --out DIR``: does difficulty filtering pay, at equal tokens?

1. **Student**: the programmatic teacher writes ``pretrain_problems`` problems from the TRAIN
   templates (its own seed); their verified solutions in the chat template are the corpus of a
   tiny Llama pre-trained from scratch by the platform's ``pretrain`` task.
2. **Data set, once**: the teacher writes ``problems`` new TRAIN-template problems with ``k``
   solutions each (``error_rate`` of them with a planted error); verify (``majority``), dedup and
   decontaminate against every eval test split, pass rate of each problem from ``samples``
   completions of the student at temperature 1; the 20-80 % band is written as the data set
   (shards, ``sft.jsonl``, content hash, lineage) under ``DIR/dataset``.
3. **Four subsets** of the deduplicated problems: ``unfiltered``, ``band`` (``lo <= rate <=
   hi``), ``easy`` (``> hi``), ``hard`` (``< lo``). Each is written as an ``sft.jsonl`` of exactly
   ``sft_tokens`` tokens or fewer by less than one conversation (rows drawn in seeded shuffled
   passes, repeated as needed), and the student is fine-tuned on it by the ``sft`` task for one
   pass over its rows, ``sft_seeds`` times (training seeds ``seed``, ``seed + 1``, …): same
   tokens, same recipe.
4. **Held-out evaluation**: ``held_out`` problems from the HELD-OUT templates (other wordings of
   the same skills, never trained on), verified like the rest; every fine-tuned student answers
   each greedily; a subset's score on a problem is the mean over its seeds; accuracy with its 95 %
   interval (Wilson's for one seed, else a bootstrap over problems), and band minus unfiltered over
   the same problems with a paired bootstrap interval (:func:`forge_kit.stats.paired_compare`).

``DIR/summary.json``: ``subsets.{unfiltered,band,easy,hard}`` (``problems``, ``rows``, ``tokens``,
``steps``, ``accuracy``, ``ci95``, per-seed ``seeds``), ``base`` (the student before fine-tuning),
``band_vs_unfiltered`` (``delta``, paired ``ci95``, ``p_value``, per-seed deltas ``seeds``),
``stages`` (counts at every stage), ``config``, ``wall_s``.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from tokenizers import Tokenizer

from forge_kit.objectstore import ObjectStore
from forge_kit.paths import data_dir
from forge_kit.stats import item_means, mean_estimate, paired_compare, wilson_interval
from forge_training import recipes
from forge_training.synthetic import dataset, dedup, difficulty
from forge_training.synthetic.problems import (
    DEV_TEMPLATES,
    HELD_OUT_TEMPLATES,
    TRAIN_TEMPLATES,
    ProgrammaticTeacher,
    generate,
)
from forge_training.synthetic.student import HFStudent
from forge_training.synthetic.verify import Verified, Verifier, grade, numbers_match, parse_answer
from forge_training.train import RunContext
from forge_training.train import train as run_training

SUBSETS = ("unfiltered", "band", "easy", "hard")


@dataclass(frozen=True)
class BenchConfig:
    seed: int = 0
    pretrain_problems: int = 16000
    pretrain_steps: int = 1600
    problems: int = 6000
    k: int = 4
    error_rate: float = 0.2
    pot_rate: float = 0.1
    samples: int = 8
    lo: float = 0.2
    hi: float = 0.8
    sft_tokens: int = 150_000
    held_out: int = 1000
    dev: int = 480
    max_new_tokens: int = 64
    hidden_size: int = 96
    num_layers: int = 3
    seq_len: int = 256
    sft_seq_len: int = 256
    vocab_size: int = 260
    batch: int = 16
    sft_lr: float = 5e-4
    sft_seeds: int = 3


def _ctx(root: Path, cache: Path) -> RunContext:
    return RunContext(run_id="bench", run_dir=root, store=ObjectStore(str(root / "objects")), cache_dir=cache)


def _train(recipe: str, overrides: dict[str, Any], root: Path, cache: Path) -> tuple[Path, dict[str, Any]]:
    config = recipes.build(recipe, {k: str(v) for k, v in overrides.items()})
    started = time.perf_counter()
    result = run_training(config, _ctx(root, cache))
    if result.export_dir is None:
        raise RuntimeError(f"{recipe}: training ended {result.outcome} without an export")
    figures = {
        "steps": result.step,
        "wall_s": round(time.perf_counter() - started, 1),
        "final_loss": result.losses.get(result.step),
        "val_loss": result.eval_metrics.get("val_loss"),
    }
    return result.export_dir, figures


def pretrain_student(cfg: BenchConfig, verifier: Verifier, work: Path) -> tuple[Path, dict[str, Any]]:
    """Step 1: the corpus of verified teacher text and the pre-trained tiny Llama's export."""
    teacher = ProgrammaticTeacher(seed=cfg.seed + 1000, error_rate=cfg.error_rate, pot_rate=0.0)
    # k = 3: with one solution a planted wrong final answer is the only readable one and is kept
    written = generate(teacher, TRAIN_TEMPLATES, cfg.pretrain_problems, 3)
    kept = verifier.verify(written.problems).kept
    corpus = work / "pretrain" / "corpus.txt"
    corpus.parent.mkdir(parents=True, exist_ok=True)
    corpus.write_text("".join(dataset.chat_text(v.problem.question, v.solutions[0].plain()) for v in kept))
    h, layers = cfg.hidden_size, cfg.num_layers
    export, figures = _train(
        "shakespeare_tiny",
        {
            "data.corpus": corpus, "data.vocab_size": cfg.vocab_size, "data.seq_len": cfg.seq_len,
            "data.val_fraction": 0.05, "model.hidden_size": h, "model.intermediate_size": 8 * h // 3,
            "model.num_layers": layers, "model.num_heads": 4, "model.num_kv_heads": 4,
            "global_batch_size": cfg.batch, "micro_batch_size": cfg.batch, "max_steps": cfg.pretrain_steps,
            "optim.lr": 2e-3, "optim.min_lr": 2e-4, "optim.warmup_steps": 30,
            "eval_interval": cfg.pretrain_steps, "eval_batches": 4, "log_interval": 50,
            "checkpoint.interval_steps": 0, "seed": cfg.seed,
        },
        work / "pretrain" / "run",
        work / "cache",
    )  # fmt: skip
    return export, {"corpus_problems": len(kept), "corpus_chars": corpus.stat().st_size, **figures}


def equal_token_rows(
    rows: list[dict[str, str]], tokens: list[int], budget: int, seed: int
) -> tuple[list[dict[str, str]], int]:
    """Rows drawn in seeded shuffled passes over ``rows`` until the next would pass ``budget``
    tokens; returns them and their tokens."""
    if not rows:
        return [], 0
    rng = random.Random(seed)
    out: list[dict[str, str]] = []
    total = 0
    while True:
        order = list(range(len(rows)))
        rng.shuffle(order)
        for i in order:
            if total + tokens[i] > budget:
                return out, total
            out.append(rows[i])
            total += tokens[i]


def _sft_tokens(tok: Tokenizer, items: list[Verified]) -> list[int]:
    texts = [dataset.chat_text(v.problem.question, v.solutions[0].plain()) for v in items]
    return [len(e.ids) for e in tok.encode_batch(texts)]


def evaluate(model: Path, held: list[Verified], cfg: BenchConfig) -> list[float]:
    student = HFStudent(model)
    prompts = [difficulty.prompt_of(v.problem.question) for v in held]
    out = student.sample(prompts, 1, temperature=0.0, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed)
    return [float(grade(c[0], v.answer)) for c, v in zip(out, held, strict=True)]


def _accuracy(scores: list[float], seed: int = 0) -> dict[str, Any]:
    """Mean score with its 95 % interval: Wilson's when every score is 0/1 (one model), else a
    seeded bootstrap over problems (scores averaged over fine-tuning seeds)."""
    if all(s in (0.0, 1.0) for s in scores):
        low, high = wilson_interval(sum(scores), len(scores))
        return {
            "accuracy": sum(scores) / len(scores),
            "ci95": [low, high],
            "n": len(scores),
            "interval": "wilson",
        }
    est = mean_estimate(scores, seed=seed)
    return {
        "accuracy": est.value,
        "ci95": [est.ci_low, est.ci_high],
        "n": len(scores),
        "interval": "bootstrap",
    }


def _wrong_kept(items: list[Verified]) -> int:
    """Kept problems whose verified answer differs from the teacher's own (verifier errors)."""
    wrong = 0
    for v in items:
        a, b = parse_answer(v.answer), parse_answer(v.problem.reference)
        wrong += a is None or b is None or not numbers_match(a, b)
    return wrong


def _band_vs_unfiltered(scores: dict[str, list[float]], seed: int) -> dict[str, Any]:
    """The band's per-problem scores against unfiltered's on the same problems, paired."""
    return paired_compare(scores["unfiltered"], scores["band"], seed=seed).summary()


def run_bench(
    cfg: BenchConfig, out: Path, tasks_dir: Path, log: Any = print, student: Path | None = None
) -> dict[str, Any]:
    """The benchmark; ``student``: an export of an earlier run's step 1 (same config) to start from
    instead of pre-training again."""
    started = time.perf_counter()
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    verifier = Verifier("majority")
    stages: dict[str, Any] = {}
    # 1. The student.
    if student is None:
        log("pre-training the student")
        student_dir, stages["pretrain"] = pretrain_student(cfg, verifier, work)
    else:
        student_dir, stages["pretrain"] = student, {"reused": str(student)}
    # 2. The data set: generate, verify, dedup, difficulty.
    log("generating and verifying")
    teacher = ProgrammaticTeacher(seed=cfg.seed, error_rate=cfg.error_rate, pot_rate=cfg.pot_rate)
    gen = generate(teacher, TRAIN_TEMPLATES, cfg.problems, cfg.k)
    stages["generate"] = {"problems": len(gen.problems), "failures": gen.failures}
    verified = verifier.verify(gen.problems)
    stages["verify"] = {**verified.counts(), "kept_with_wrong_answer": _wrong_kept(verified.kept)}
    log("deduplicating and decontaminating")
    sources, skipped = dedup.benchmark_sources(tasks_dir, data_dir())
    deduped = dedup.dedup(verified.kept, dedup.Decontaminator(sources))
    stages["dedup"] = {
        **deduped.counts(),
        "benchmarks": {s.name: len(s.texts) for s in sources},
        "skipped": skipped,
    }
    log("pass rates")
    sampler = HFStudent(student_dir)
    rates = difficulty.pass_rates(
        sampler, deduped.kept, cfg.samples, temperature=1.0, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed
    )
    band = difficulty.band_filter(deduped.kept, rates, cfg.lo, cfg.hi)
    stages["difficulty"] = {**band.counts(), "samples": cfg.samples, "temperature": 1.0}
    tok = Tokenizer.from_file(str(student_dir / "tokenizer.json"))
    lineage = {
        "teacher": {"name": teacher.name, "seed": teacher.seed, "error_rate": teacher.error_rate,
                    "pot_rate": teacher.pot_rate, "k": cfg.k},
        "templates": [t.id for t in TRAIN_TEMPLATES],
        "seed": cfg.seed,
        "filters": {"verify": "majority", "dedup": {"within": 0.9, "benchmarks": 0.5},
                    "difficulty": {"student": "bench pretrain", "band": [cfg.lo, cfg.hi], "samples": cfg.samples}},
        "stages": stages,
    }  # fmt: skip
    written = dataset.write_dataset(out / "dataset", band.kept, lineage, tokenizer=tok)
    stages["dataset"] = {
        "problems": written.problems,
        "tokens": written.tokens,
        "content_hash": written.content_hash,
    }
    # 3. Four subsets at equal tokens.
    items = deduped.kept
    members = {
        "unfiltered": list(range(len(items))),
        "band": [i for i, r in enumerate(rates) if cfg.lo <= r <= cfg.hi],
        "easy": [i for i, r in enumerate(rates) if r > cfg.hi],
        "hard": [i for i, r in enumerate(rates) if r < cfg.lo],
    }
    all_rows = dataset.sft_rows(items)
    all_tokens = _sft_tokens(tok, items)
    # 4. Held-out problems.
    held_teacher = ProgrammaticTeacher(seed=cfg.seed + 2000, error_rate=cfg.error_rate, pot_rate=cfg.pot_rate)
    held_gen = generate(held_teacher, HELD_OUT_TEMPLATES, cfg.held_out, cfg.k)
    held = verifier.verify(held_gen.problems).kept
    stages["held_out"] = {
        "problems": len(held_gen.problems),
        "kept": len(held),
        "wrong_kept": _wrong_kept(held),
    }
    # DEV wordings of the TRAIN templates (never trained on): the selection set.
    dev_teacher = ProgrammaticTeacher(seed=cfg.seed + 3000, error_rate=cfg.error_rate, pot_rate=cfg.pot_rate)
    dev = verifier.verify(generate(dev_teacher, DEV_TEMPLATES, cfg.dev, cfg.k).problems).kept
    stages["dev"] = {"problems": cfg.dev, "kept": len(dev)}
    log("evaluating the base student")
    scores: dict[str, list[float]] = {"base": evaluate(student_dir, held, cfg)}
    dev_scores: dict[str, list[float]] = {"base": evaluate(student_dir, dev, cfg)}
    subsets: dict[str, Any] = {"base": {**_accuracy(scores["base"]), "dev": _accuracy(dev_scores["base"])}}
    for name in SUBSETS:
        idx = members[name]
        rows, tokens = equal_token_rows(
            [all_rows[i] for i in idx], [all_tokens[i] for i in idx], cfg.sft_tokens, cfg.seed
        )
        distinct = len({r["chosen"] for r in rows})
        entry: dict[str, Any] = {
            "problems": len(idx), "rows": len(rows), "tokens": tokens, "distinct": distinct,
            "repeats": round(len(rows) / distinct, 2) if distinct else None,
        }  # fmt: skip
        steps = (len(rows) - max(1, int(len(rows) * 0.02))) // cfg.batch
        if steps < 1:
            subsets[name] = {**entry, "accuracy": None, "ci95": None, "skipped": "too few rows for one step"}
            continue
        path = work / "sft" / name / "sft.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        held_runs: list[list[float]] = []
        dev_runs: list[list[float]] = []
        per_seed: list[dict[str, Any]] = []
        for j in range(cfg.sft_seeds):
            sft_seed = cfg.seed + j
            log(f"fine-tuning on {name} (seed {sft_seed}): {len(rows)} rows, {tokens} tokens, {steps} steps")
            run_dir = work / "sft" / name / ("run" if j == 0 else f"run-seed{sft_seed}")
            model, figures = _train(
                "sft_hh",
                {
                    "init.parent": student_dir, "pairs.path": path, "data.seq_len": cfg.sft_seq_len,
                    "data.val_fraction": 0.02, "global_batch_size": cfg.batch, "micro_batch_size": cfg.batch,
                    "max_steps": steps, "optim.lr": cfg.sft_lr, "optim.min_lr": cfg.sft_lr / 10,
                    "optim.warmup_steps": min(10, steps - 1), "eval_interval": steps, "eval_batches": 1,
                    "log_interval": 50, "checkpoint.interval_steps": 0, "seed": sft_seed,
                },
                run_dir,
                work / "cache",
            )  # fmt: skip
            held_runs.append(evaluate(model, held, cfg))
            dev_runs.append(evaluate(model, dev, cfg))
            per_seed.append({
                "seed": sft_seed, "accuracy": sum(held_runs[-1]) / len(held), "dev_accuracy":
                sum(dev_runs[-1]) / len(dev), "train": figures,
            })  # fmt: skip
        scores[name] = item_means(held_runs)
        dev_scores[name] = item_means(dev_runs)
        subsets[name] = {
            **entry, "steps": steps, **_accuracy(scores[name], cfg.seed),
            "dev": _accuracy(dev_scores[name], cfg.seed), "train": per_seed[0]["train"], "seeds": per_seed,
        }  # fmt: skip
    summary: dict[str, Any] = {"subsets": subsets, "stages": stages, "config": dataclasses.asdict(cfg)}
    if "band" in scores and "unfiltered" in scores:
        held_out = _band_vs_unfiltered(scores, cfg.seed)
        summary["band_vs_unfiltered"] = {**held_out, "target_met": held_out["ci95"][0] > 0}
        summary["band_vs_unfiltered_dev"] = _band_vs_unfiltered(dev_scores, cfg.seed)
        for key, field in (("band_vs_unfiltered", "accuracy"), ("band_vs_unfiltered_dev", "dev_accuracy")):
            summary[key]["seeds"] = [
                b[field] - u[field]
                for b, u in zip(subsets["band"]["seeds"], subsets["unfiltered"]["seeds"], strict=True)
            ]
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    return summary


def synthetic(
    out: Annotated[Path, typer.Option(help="directory for summary.json, the data set and the runs")],
    seed: Annotated[int, typer.Option(help="seed of the teacher, the splits and the training")] = 0,
    tasks_dir: Annotated[
        Path | None, typer.Option(help="the eval service's task folder (default: this checkout's)")
    ] = None,
    quick: Annotated[bool, typer.Option(help="a few-minute run with small counts (a smoke test)")] = False,
    student: Annotated[
        Path | None,
        typer.Option(help="an earlier run's pre-trained student (DIR/work/pretrain/run/…/export)"),
    ] = None,
    problems: Annotated[
        int, typer.Option(help="size of the pool the subsets are drawn from (problems written)")
    ] = BenchConfig.problems,
    sft_seeds: Annotated[
        int,
        typer.Option(help="fine-tunes per subset (training seeds seed, seed+1, …); scores are their mean"),
    ] = BenchConfig.sft_seeds,
) -> None:
    """Synthetic reasoning data: the 20-80 % band against unfiltered, easy and hard subsets at equal
    tokens, on problems from held-out templates (see load/synthetic/README.md)."""
    if sft_seeds < 1:
        raise typer.BadParameter(f"--sft-seeds must be at least 1, got {sft_seeds}")
    cfg = BenchConfig(seed=seed, sft_seeds=sft_seeds, problems=problems)
    if quick:
        cfg = dataclasses.replace(
            cfg,
            pretrain_problems=600,
            pretrain_steps=60,
            problems=120,
            held_out=60,
            dev=40,
            sft_tokens=8000,
            samples=4,
        )
    out.mkdir(parents=True, exist_ok=True)
    summary = run_bench(
        cfg,
        out,
        tasks_dir or dedup.default_tasks_dir(),
        log=lambda m: typer.echo(f"== {m}", err=True),
        student=student,
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    typer.echo(
        json.dumps({k: summary[k] for k in ("subsets", "band_vs_unfiltered") if k in summary}, indent=2)
    )
