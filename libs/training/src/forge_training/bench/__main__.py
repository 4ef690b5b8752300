"""``python -m forge_training.bench NAME …``: a training benchmark without the ``forge`` CLI."""

from forge_training.bench import app

app()
