"""The parallelism planner, ``forge plan``: :mod:`.spec` (what it plans for: models, GPUs, the
request, a layout), :mod:`.cost` (every estimate, a documented function), :mod:`.planner` (the
search) and :mod:`.cli` (the command)."""
