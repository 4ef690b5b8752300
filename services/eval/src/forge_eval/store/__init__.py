"""Eval persistence: the model registry's tables (:mod:`.registry`) and the runs' (:mod:`.runs`).

Each module holds its tables and the queries both services share; the Alembic environment imports
both to register them.
"""

from __future__ import annotations
