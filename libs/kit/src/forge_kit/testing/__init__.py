"""Test helpers: free ports, the real local broker and Temporal dev server, service processes and
their base settings, waiting for a condition."""

from forge_kit.testing.processes import (
    MlflowServer,
    ServiceProcess,
    TansuBroker,
    TemporalDevServer,
    base_env,
    free_port,
    wait_for_port,
)
from forge_kit.testing.waiting import eventually

__all__ = [
    "MlflowServer",
    "ServiceProcess",
    "TansuBroker",
    "TemporalDevServer",
    "base_env",
    "eventually",
    "free_port",
    "wait_for_port",
]
