"""``forge load inference``: serving load against the gateway, a model server or ``vllm serve``.

Registered under the ``forge.cli`` entry-point group as ``load``; the measurement is
:mod:`forge_inference_gateway.bench.loadgen` (vLLM's ``bench serve`` methodology).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from forge_inference_gateway.bench.loadgen import LoadSpec, parse_goodput, run_load
from forge_kit import clitools

app = typer.Typer(add_completion=False, help="Load and soak scenarios.")


@app.callback()
def load() -> None:
    """Load and soak scenarios (``forge load inference``)."""


@app.command()
def inference(
    base_url: Annotated[
        str, typer.Option(help="OpenAI-compatible server: the gateway, model_server or vLLM")
    ],
    model: Annotated[str, typer.Option(help="Model id or alias to request")],
    num_prompts: Annotated[int, typer.Option(help="Requests to send")],
    out: Annotated[Path, typer.Option(help="Folder for results.json and the plots")],
    request_rate: Annotated[
        float | None, typer.Option(help="Requests per second (inf: all at once); or --max-concurrency")
    ] = None,
    max_concurrency: Annotated[
        int | None, typer.Option(help="Requests in flight at most; alone, a closed loop of that many clients")
    ] = None,
    burstiness: Annotated[float, typer.Option(help="Gamma shape of arrival gaps; 1 is Poisson")] = 1.0,
    input_len: Annotated[
        int, typer.Option(help="Mean prompt length (tokens with --tokenizer, else words)")
    ] = 128,
    output_len: Annotated[
        int, typer.Option(help="Mean output length in tokens (forced with ignore_eos)")
    ] = 64,
    range_ratio: Annotated[float, typer.Option(help="Lengths are uniform in len·(1 ± ratio)")] = 0.5,
    goodput: Annotated[
        list[str] | None, typer.Option(help="SLOs for goodput, e.g. ttft:500 (repeat, or comma separated)")
    ] = None,
    sweep_rates: Annotated[str, typer.Option(help="Comma-separated rates for throughput_vs_rate.png")] = "",
    api_key: Annotated[
        str,
        clitools.token_option(
            "FORGE_CLI_LOAD_API_KEY", "bearer key (a gateway tenant key)", "--api-key-file"
        ),
    ] = "",
    tokenizer: Annotated[
        str | None, typer.Option(help="Model folder whose tokenizer sizes the prompts")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of lengths, prompts and arrivals")] = 0,
    quiet: Annotated[bool, clitools.QuietOption] = False,
) -> None:
    """Drive a server with vLLM's ``bench serve`` method; write ``OUT/results.json`` and the plots."""
    if request_rate is None and max_concurrency is None:
        raise typer.BadParameter("give --request-rate or --max-concurrency", param_hint="--request-rate")
    try:
        spec = LoadSpec(
            base_url=base_url,
            model=model,
            num_prompts=num_prompts,
            out=out,
            request_rate=request_rate if request_rate is not None else math.inf,
            max_concurrency=max_concurrency,
            burstiness=burstiness,
            input_len=input_len,
            output_len=output_len,
            range_ratio=range_ratio,
            goodput=parse_goodput(goodput or []),
            sweep_rates=tuple(float(r) for r in sweep_rates.split(",") if r.strip()),
            api_key=api_key or None,
            tokenizer=tokenizer,
            seed=seed,
        )
        with clitools.progress(quiet) as bar:

            def phase(name: str, total: int) -> Callable[[], None]:
                step = bar.add_task(f"requests, {name}", total=total)
                return lambda: bar.advance(step)

            summary = run_load(spec, phase)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    typer.echo(json.dumps(summary))
    if summary["completed"] == 0:
        raise typer.Exit(1)
