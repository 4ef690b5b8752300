"""The training library's benchmarks, one module each, every one a ``forge bench`` command through
the entry-point group ``forge.bench`` (this package's pyproject), never imported by the CLI itself:

- ``train``, ``recipes`` (:mod:`.train`): quality against nanoGPT, DDP and FSDP speed, checkpoint
  stall; the post-training recipe chain (``load/training``);
- ``sweep`` (:mod:`.sweep_cli` around :mod:`.sweep`): ASHA against the full grid (``load/sweep``);
- ``cpt`` (:mod:`.cpt`): the CPT workflow's mixture search, in-process (``load/cpt``);
- ``vlm`` (:mod:`.vlm`): the VLM curriculum against joint training (``load/vlm``);
- ``synthetic`` (:mod:`forge_training.synthetic.bench`, with the use case it measures):
  difficulty-filtered synthetic data against unfiltered (``load/synthetic``).

``python -m forge_training.bench NAME …`` runs the same commands without the ``forge`` CLI: :data:`app`
lists this library's own entry points.
"""

from __future__ import annotations

import typer

from forge_kit import clitools


class TrainingBenchGroup(clitools.EntryPointGroup):
    """The ``forge.bench`` entry points this library declares."""

    distribution = "forge-training"


app = typer.Typer(
    cls=TrainingBenchGroup,
    add_completion=False,
    no_args_is_help=True,
    help="Training benchmarks (the forge.bench entry points of forge-training).",
)


@app.callback()
def bench() -> None:
    """Training benchmarks (the ``forge.bench`` entry points of forge-training)."""
