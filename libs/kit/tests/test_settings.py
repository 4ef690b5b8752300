"""ServiceSettings: env prefix, unknown keys fail at start-up, derived service name."""

from __future__ import annotations

import pydantic
import pytest

from forge_kit.settings import ServiceSettings, service_config


class SchedulerSettings(ServiceSettings):
    model_config = service_config("scheduler")

    max_queue: int = 10
    """Jobs a queue holds."""


class GatewaySettings(ServiceSettings):
    model_config = service_config("inference_gateway")


def test_values_come_from_prefixed_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORGE_SCHEDULER_GRPC_PORT", "50051")
    monkeypatch.setenv("FORGE_SCHEDULER_MAX_QUEUE", "3")
    monkeypatch.setenv("FORGE_SCHEDULER_AUTH_TOKEN", "t0k")
    settings = SchedulerSettings()
    assert settings.grpc_port == 50051
    assert settings.max_queue == 3
    assert settings.auth_token.get_secret_value() == "t0k"
    assert "t0k" not in repr(settings)


def test_init_arguments_win_over_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORGE_SCHEDULER_GRPC_PORT", "50051")
    assert SchedulerSettings(grpc_port=7).grpc_port == 7


def test_other_services_env_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORGE_RERANKER_GRPC_PORT", "1234")
    assert SchedulerSettings().grpc_port == 0


def test_unknown_prefixed_env_var_fails_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORGE_SCHEDULER_GRPC_PROT", "50051")
    with pytest.raises(pydantic.ValidationError, match="FORGE_SCHEDULER_GRPC_PROT"):
        SchedulerSettings()


def test_unknown_init_argument_fails() -> None:
    with pytest.raises(pydantic.ValidationError, match="grpc_prot"):
        SchedulerSettings(grpc_prot=1)  # type: ignore[call-arg]


def test_invalid_value_fails_naming_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORGE_SCHEDULER_GRPC_PORT", "70000")
    with pytest.raises(pydantic.ValidationError, match="grpc_port"):
        SchedulerSettings()


def test_service_name_is_derived_from_the_prefix() -> None:
    assert SchedulerSettings().service_name == "scheduler"
    assert GatewaySettings().service_name == "inference_gateway"
    assert SchedulerSettings(service_name="sched-a").service_name == "sched-a"


def test_sqlite_url_defaults_under_data_dir(tmp_path: object) -> None:
    settings = SchedulerSettings(data_dir=str(tmp_path))
    assert settings.sqlite_url("x.db") == f"sqlite+aiosqlite:///{tmp_path}/x.db"
    explicit = SchedulerSettings(database_url="postgresql+asyncpg://h/db")
    assert explicit.sqlite_url("x.db") == "postgresql+asyncpg://h/db"


def test_every_field_has_a_docstring() -> None:
    undocumented = [
        name for name, info in ServiceSettings.model_fields.items() if not (info.description or "").strip()
    ]
    assert undocumented == []
