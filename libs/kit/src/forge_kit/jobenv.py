"""The environment contract between the trainer agent and the job replicas it runs.

A job learns where to say why it failed from ``$FORGE_TERMINATION_LOG`` (as Kubernetes'
``terminationMessagePath``); the agent reports that message instead of the log's last lines, which
under torchrun are torchrun's own failure summary rather than the worker's reason.
"""

from __future__ import annotations

import contextlib
import os

TERMINATION_LOG_ENV = "FORGE_TERMINATION_LOG"
"""Names the file where a replica may say why it failed."""


def write_termination_message(message: str) -> None:
    """Called by a job that is about to fail: record ``message`` where the agent will look
    (``$FORGE_TERMINATION_LOG``; nothing when the job runs outside an agent). The first replica
    to write wins, as the root cause torchrun reports is the first failure observed."""
    path = os.environ.get(TERMINATION_LOG_ENV)
    if not path:
        return
    with contextlib.suppress(FileExistsError), open(path, "x", encoding="utf-8") as handle:
        handle.write(message)
