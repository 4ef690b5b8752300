"""What a main-job step sees of ``forge up``'s platform, as typing protocols.

The steps live in the services (entry points ``forge.main_job``) and must not import the CLI that
runs them; they type their argument with :class:`MainJobContext` and the CLI's own dataclass
(``forge_cli.mainjob.MainJobContext``) satisfies it structurally.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol


class Endpoint(Protocol):
    """One service of the platform: its gRPC target, HTTP base URL and the bearer token it takes."""

    @property
    def grpc_target(self) -> str: ...

    @property
    def http_url(self) -> str: ...

    @property
    def token(self) -> str: ...


class MainJobContext(Protocol):
    """The platform's addresses and the earlier steps' results, by step name."""

    @property
    def root(self) -> Path: ...

    @property
    def results(self) -> Mapping[str, Mapping[str, Any]]: ...

    @property
    def object_store_url(self) -> str: ...

    @property
    def mlflow_url(self) -> str: ...

    def endpoint(self, name: str) -> Endpoint: ...
