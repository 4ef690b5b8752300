"""Sweeps and ablations: the ``sweep`` workflow, its activities, the metrics router, the report
and the ``forge sweep`` CLI."""
