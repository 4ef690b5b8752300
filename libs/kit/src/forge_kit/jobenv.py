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


SERVE_PORT_ENV = "FORGE_SERVE_PORT"
"""A serving job's (``JOB_KIND_INFERENCE``) port, assigned by the agent that runs it."""

SERVE_PORT_PLACEHOLDER = "{serve_port}"
"""Written in a serving job's command arguments or environment values, replaced by the agent with
the port it assigned (e.g. ``--port {serve_port}``), so an engine that takes its port only as a
flag or a setting of its own needs no wrapper."""


def with_serve_port(values: list[str], port: int) -> list[str]:
    """``values`` with every :data:`SERVE_PORT_PLACEHOLDER` replaced by ``port``."""
    return [v.replace(SERVE_PORT_PLACEHOLDER, str(port)) for v in values]
