"""Test helpers: free ports, the real local broker and Temporal dev server, service processes."""

from forge_kit.testing.processes import (
    MlflowServer,
    ServiceProcess,
    TansuBroker,
    TemporalDevServer,
    free_port,
    wait_for_port,
)

__all__ = ["MlflowServer", "ServiceProcess", "TansuBroker", "TemporalDevServer", "free_port", "wait_for_port"]
