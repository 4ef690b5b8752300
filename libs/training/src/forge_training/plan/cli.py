"""``forge plan``: propose tensor / pipeline / data parallel degrees and a ZeRO stage.

    forge plan --model llama-70b --gpus 512 --gpu-type A100-80GB --seq-len 4096 --global-batch-tokens 4M

Translates flags into a ``plan.PlanRequest``, runs ``plan.plan`` and prints the result as tables
or ``--json``. Bad input exits 2 with the offending flag named.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from forge_training.plan import cost as plan_cost
from forge_training.plan import planner
from forge_training.plan import spec as plan_spec
from forge_training.plan.planner import Candidate, Plan
from forge_training.plan.spec import GIB, PlanError, PlanRequest

app = typer.Typer(add_completion=False, help="Parallelism planner.")


def _fail(err: PlanError) -> NoReturn:
    """Every ``PlanError`` field is a flag's name with underscores: exit 2 naming the flag."""
    typer.echo(f"error: --{err.field.replace('_', '-')}: {err.message}", err=True)
    raise typer.Exit(2)


@app.command("plan")
def plan_cmd(
    model: Annotated[
        str,
        typer.Option(
            "--model",
            help=f"Preset ({', '.join(plan_spec.MODEL_PRESETS)}) or a parameter count such as 7B or 1.3e9.",
        ),
    ],
    gpus: Annotated[int, typer.Option("--gpus", help="Number of GPUs.")],
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per sequence.")],
    gpu_type: Annotated[
        str,
        typer.Option(
            "--gpu-type",
            help=f"{', '.join(g.name for g in plan_spec.GPU_PRESETS.values())} or custom (with the four GPU figures).",
        ),
    ] = "A100-80GB",
    global_batch_tokens: Annotated[
        str | None,
        typer.Option("--global-batch-tokens", help="Tokens per step, e.g. 4M (binary: 4M = 4·2²⁰)."),
    ] = None,
    global_batch_seqs: Annotated[
        int | None, typer.Option("--global-batch-seqs", help="Sequences per step (instead of tokens).")
    ] = None,
    micro_batch: Annotated[int, typer.Option("--micro-batch", help="Sequences per micro-batch.")] = 1,
    mfu: Annotated[
        float, typer.Option("--mfu", help="Fraction of peak FLOP/s the kernels sustain.")
    ] = plan_spec.DEFAULT_MFU,
    headroom: Annotated[
        float, typer.Option("--headroom", help="Fraction of GPU memory to leave free.")
    ] = plan_spec.DEFAULT_HEADROOM,
    link_efficiency: Annotated[
        float, typer.Option("--link-efficiency", help="Fraction of nominal link bandwidth collectives reach.")
    ] = plan_spec.DEFAULT_LINK_EFFICIENCY,
    sequence_parallel: Annotated[
        bool,
        typer.Option(
            "--sequence-parallel/--no-sequence-parallel", help="Megatron sequence parallelism with tp > 1."
        ),
    ] = True,
    gpu_memory_gib: Annotated[float | None, typer.Option("--gpu-memory-gib", help="GPU memory, GiB.")] = None,
    gpu_tflops: Annotated[float | None, typer.Option("--gpu-tflops", help="Peak dense bf16 TFLOP/s.")] = None,
    intra_node_gbs: Annotated[
        float | None, typer.Option("--intra-node-gbs", help="GB/s per GPU within a node, one direction.")
    ] = None,
    inter_node_gbs: Annotated[
        float | None, typer.Option("--inter-node-gbs", help="GB/s per GPU between nodes, one direction.")
    ] = None,
    gpus_per_node: Annotated[int | None, typer.Option("--gpus-per-node", help="GPUs per node.")] = None,
    layers: Annotated[int | None, typer.Option("--layers", help="Override the model's layer count.")] = None,
    hidden: Annotated[int | None, typer.Option("--hidden", help="Override the hidden size.")] = None,
    heads: Annotated[int | None, typer.Option("--heads", help="Override the attention heads.")] = None,
    kv_heads: Annotated[int | None, typer.Option("--kv-heads", help="Override the KV heads.")] = None,
    ffn: Annotated[int | None, typer.Option("--ffn", help="Override the MLP width.")] = None,
    vocab: Annotated[int | None, typer.Option("--vocab", help="Override the vocabulary size.")] = None,
    top: Annotated[int, typer.Option("--top", help="Alternatives to show.")] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Propose tp / pp / dp and a ZeRO stage; print memory per GPU and communication per step."""
    try:
        spec = plan_spec.resolve_model(
            model, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab
        )
        gpu = plan_spec.resolve_gpu(
            gpu_type,
            memory_gib=gpu_memory_gib,
            tflops=gpu_tflops,
            intra_node_gbs=intra_node_gbs,
            inter_node_gbs=inter_node_gbs,
            gpus_per_node=gpus_per_node,
        )
        tokens = (
            None
            if global_batch_tokens is None
            else plan_spec.parse_count(global_batch_tokens, field="global_batch_tokens", binary=True)
        )
        seqs = plan_spec.global_batch_seqs(seq_len, tokens=tokens, seqs=global_batch_seqs)
        request = PlanRequest(
            model=spec,
            gpu=gpu,
            gpus=gpus,
            seq_len=seq_len,
            global_batch_seqs=seqs,
            micro_batch=micro_batch,
            mfu=mfu,
            headroom=headroom,
            link_efficiency=link_efficiency,
            sequence_parallel=sequence_parallel,
            top=top,
        )
        result = planner.plan(request)
    except PlanError as err:
        _fail(err)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
        return
    console = Console()
    if not console.is_terminal:
        console.width = 140
    render(result, console)


def _gib(n: float) -> str:
    return f"{n / GIB:,.1f}"


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f}"


def render(result: Plan, console: Console) -> None:
    """The plan as rich tables: summary, memory, communication, alternatives, rejections."""
    req, best = result.request, result.best
    cfg = best.config
    params = plan_spec.param_count(req.model)
    console.print(
        f"[bold]{req.model.name}[/] ({params / 1e9:.2f}B params, {req.model.layers} layers, h={req.model.hidden}, "
        f"{req.model.heads} heads / {req.model.kv_heads} KV) on {req.gpus} × {req.gpu.name} "
        f"({req.gpu.gpus_per_node} per node); {req.global_batch_seqs} × {req.seq_len} = "
        f"{req.tokens_per_step:,} tokens per step"
    )
    sp = " + sequence parallel" if cfg.sequence_parallel else ""
    console.print(
        f"[bold green]Best:[/] tp={cfg.tp} pp={cfg.pp} dp={cfg.dp}, ZeRO-{cfg.zero}, recompute={cfg.recompute.value}"
        f"{sp}, micro-batch {cfg.micro_batch} × {cfg.micro_batches} micro-batches — "
        f"{best.time.total_s:.2f} s/step, {best.time.tokens_per_s:,.0f} tokens/s, MFU {best.time.mfu:.1%} "
        f"(assumed kernel efficiency {req.mfu:.0%}), bubble {best.bubble_fraction:.1%}"
    )
    console.print(
        f"  {result.evaluated} configurations evaluated, {result.fitting} fit; "
        f"{len(result.rejected)} rejected"
    )

    memory = Table(title=f"Memory per GPU, GiB (stage {best.memory.stage} of {cfg.pp})")
    memory.add_column("part")
    memory.add_column("GiB", justify="right")
    memory.add_column("formula")
    states = {
        0: "2Ψ + 2Ψ + 12Ψ",
        1: "2Ψ + 2Ψ + 12Ψ/dp",
        2: "2Ψ + (2Ψ + 12Ψ)/dp",
        3: "(2Ψ + 2Ψ + 12Ψ)/dp",
    }[cfg.zero]
    memory.add_row("weights (bf16)", _gib(best.memory.weights), f"ZeRO-{cfg.zero}: {states}")
    memory.add_row("gradients (bf16)", _gib(best.memory.grads), "")
    memory.add_row("optimizer (fp32 master, m, v)", _gib(best.memory.optimizer), "")
    memory.add_row(
        f"activations ({cfg.recompute.value})",
        _gib(best.memory.activations),
        "Korthikanti et al. 2022 × in-flight micro-batches",
    )
    if best.memory.buffers:
        memory.add_row("ZeRO-3 gather buffers", _gib(best.memory.buffers), "2 units of weights + 1 of grads")
    memory.add_row("[bold]total[/]", f"[bold]{_gib(best.memory.total)}[/]", "")
    memory.add_row(
        "usable", _gib(best.usable_bytes), f"{_gib(req.gpu.memory_bytes)} less {req.headroom:.0%} headroom"
    )
    console.print(memory)

    acts = Table(title="Activations per GPU by recompute mode (same stage)")
    acts.add_column("recompute")
    acts.add_column("per layer", justify="right")
    acts.add_column("activations GiB", justify="right")
    acts.add_column("total GiB", justify="right")
    acts.add_column("fits")
    non_act = best.memory.total - best.memory.activations
    for mode in plan_spec.Recompute:
        per_layer = plan_cost.activation_bytes_per_layer(
            req.seq_len,
            cfg.micro_batch,
            req.model.hidden,
            req.model.heads,
            tp=cfg.tp,
            sequence_parallel=cfg.sequence_parallel,
            recompute=mode,
        )
        act = best.activations_by_recompute[mode.value]
        acts.add_row(
            mode.value,
            f"{per_layer / 2**20:,.0f} MiB",
            _gib(act),
            _gib(non_act + act),
            "yes" if non_act + act <= best.usable_bytes else "no",
        )
    console.print(acts)

    comm = Table(title="Communication per GPU per step")
    comm.add_column("group")
    comm.add_column("size", justify="right")
    comm.add_column("link")
    comm.add_column("GB sent", justify="right")
    comm.add_column("time s", justify="right")
    comm.add_column("what")
    t = best.time
    comm.add_row(
        "tensor", str(cfg.tp), best.comm.tp_link if cfg.tp > 1 else "-", _gb(best.comm.tp_bytes), f"{t.tp_comm_s:.2f}",
        f"{plan_cost.tp_collectives_per_layer(cfg.recompute)} all-reduces of 2sbh per layer per micro-batch",
    )  # fmt: skip
    comm.add_row(
        "pipeline", str(cfg.pp), best.comm.pp_link if cfg.pp > 1 else "-", _gb(best.comm.pp_bytes), f"{t.pp_comm_s:.2f}",
        "send activation + receive gradient per micro-batch",
    )  # fmt: skip
    dp_what = {
        0: "all-reduce of gradients 2(n-1)/n·2Ψ",
        1: "reduce-scatter grads + all-gather weights",
        2: "reduce-scatter per micro-batch + all-gather",
        3: "2 all-gathers + reduce-scatter per micro-batch",
    }[cfg.zero]
    comm.add_row(
        "data", str(cfg.dp), best.comm.dp_link if cfg.dp > 1 else "-", _gb(best.comm.dp_bytes),
        f"{t.dp_comm_s:.2f} ({t.dp_exposed_s:.2f} exposed)", dp_what,
    )  # fmt: skip
    comm.add_row(
        "bubble", "", "", "", f"{t.bubble_s:.2f}", f"(pp-1)/m = {best.bubble_fraction:.3f} of compute"
    )
    comm.add_row(
        "compute",
        "",
        "",
        "",
        f"{t.compute_s:.2f}",
        f"at {req.mfu:.0%} of {req.gpu.peak_flops / 1e12:.0f} TFLOP/s",
    )
    console.print(comm)

    if result.alternatives:
        console.print(_candidates_table("Alternatives (best of each other layout)", result.alternatives))
    console.print(_rejections_table(result))


def _candidates_table(title: str, candidates: tuple[Candidate, ...]) -> Table:
    table = Table(title=title)
    for col in ("tp", "pp", "dp", "ZeRO", "recompute", "m", "GiB/GPU", "s/step", "tokens/s", "MFU", "bubble"):
        table.add_column(col, justify="right")
    for c in candidates:
        cfg = c.config
        table.add_row(
            str(cfg.tp), str(cfg.pp), str(cfg.dp), str(cfg.zero), cfg.recompute.value, str(cfg.micro_batches),
            _gib(c.memory.total), f"{c.time.total_s:.2f}", f"{c.time.tokens_per_s:,.0f}",
            f"{c.time.mfu:.1%}", f"{c.bubble_fraction:.1%}",
        )  # fmt: skip
    return table


def _rejections_table(result: Plan) -> Table:
    """One row per reason: how many were rejected for it and a few examples (closest misses first)."""
    by_reason: dict[str, list[planner.Rejection]] = defaultdict(list)
    for r in result.rejected:
        by_reason[r.reason].append(r)
    table = Table(title="Rejected")
    table.add_column("reason")
    table.add_column("count", justify="right")
    table.add_column("examples")
    for reason, items in by_reason.items():
        if reason == "memory":
            items = sorted(items, key=lambda r: r.needed_bytes or 0.0)
            examples = [
                f"tp={r.tp} pp={r.pp} dp={r.dp} ZeRO-{r.zero} {r.recompute}: {r.detail}" for r in items[:3]
            ]
        else:
            examples = list(dict.fromkeys(r.detail for r in items))[:3]
        table.add_row(planner.REASONS[reason], str(len(items)), "\n".join(examples))
    return table
