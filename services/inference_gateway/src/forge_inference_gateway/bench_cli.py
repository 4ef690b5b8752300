"""``forge bench canary`` and ``forge bench serving`` (merged with the other packages' ``forge
bench`` commands through the ``forge.cli`` entry point)."""

from __future__ import annotations

import typer

from forge_inference_gateway.canary_bench import canary
from forge_inference_gateway.serving_bench import serving

app = typer.Typer(add_completion=False, help="Benchmarks (canary, serving).")
app.command()(canary)
app.command()(serving)


@app.callback()
def bench() -> None:
    """Benchmarks (``forge bench canary``, ``forge bench serving``)."""


if __name__ == "__main__":
    app()
