"""Sweeps and ablations: the ``sweep`` workflow, its activities, the metrics handler, the report
and the ``forge sweep`` CLI."""
