"""Eval process: settings → database → benchmark catalog and runner → registry and run service →
servers + run worker."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from forge.eval.v1 import eval_pb2, eval_pb2_grpc

from forge_eval.api import EvalApi, named_tokens
from forge_eval.config import EvalSettings
from forge_eval.endpoints import EndpointRegistry
from forge_eval.registry import ModelRegistry
from forge_eval.runs import RunService
from forge_eval.serving import LocalModelServer, ModelHost, VllmModelServer
from forge_eval.task_runner import TaskCatalog, TaskSuiteRunner
from forge_eval.tasks import DataRoots
from forge_kit.app import ServiceApp
from forge_kit.paths import resolve_data_path
from forge_kit.vllm import parse_engine_flags


def model_host(settings: EvalSettings, work_dir: Path) -> ModelHost:
    """The engine that serves ``serve_model`` runs (``model_server_engine``)."""
    if settings.model_server_engine == "vllm":
        return VllmModelServer(
            settings.vllm_python,
            work_dir,
            engine_args=parse_engine_flags(settings.vllm_engine_args),
            start_timeout_s=settings.model_server_start_timeout_s,
        )
    return LocalModelServer(
        settings.model_server_command, work_dir, start_timeout_s=settings.model_server_start_timeout_s
    )


async def main() -> None:
    settings = EvalSettings()
    app = ServiceApp(settings)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per model request drowns the log
    db = await app.open_database("eval.db", Path(__file__).parent / "migrations")
    relay = app.enable_outbox()
    roots = DataRoots(resolve_data_path(settings.benchmarks_dir), resolve_data_path(settings.corpora_dir))
    data = Path(settings.data_dir).resolve()
    runner = TaskSuiteRunner(
        roots,
        cache_path=Path(settings.response_cache_path) if settings.response_cache_path else None,
        timeout_s=settings.request_timeout_s,
        batch_size=settings.request_batch_size,
        concurrency=settings.request_concurrency,
    )
    catalog = TaskCatalog(roots)
    on_commit = relay.wake if relay else lambda: None
    registry = ModelRegistry(db, producer=app.name, on_commit=on_commit)
    runs = RunService(
        db,
        catalog,
        runner,
        default_endpoint=settings.inference_gateway_url,
        producer=app.name,
        on_commit=on_commit,
        run_concurrency=settings.run_concurrency,
        model_host=model_host(settings, data / "serving"),
        reports_dir=data / "reports",
        # Each credential goes only to the endpoint it was issued for.
        endpoints=EndpointRegistry(
            {
                **{url: token.get_secret_value() for url, token in settings.model_endpoints.items()},
                settings.inference_gateway_url: settings.inference_gateway_token.get_secret_value(),
            }
        ),
    )
    app.add_background(runs.run_worker)
    app.log.info("eval.suites", roots=str(roots), suites=catalog.suites())
    api = EvalApi(registry, runs, max_page_size=settings.max_page_size)
    await app.run(
        register=[lambda server: eval_pb2_grpc.add_EvalServiceServicer_to_server(api, server)],
        service_names=[eval_pb2.DESCRIPTOR.services_by_name["EvalService"].full_name],
        authenticators=[
            named_tokens(
                {k: v.get_secret_value() for k, v in settings.admin_tokens.items()},
                {k: v.get_secret_value() for k, v in settings.user_tokens.items()},
            )
        ],
    )


if __name__ == "__main__":
    asyncio.run(main())
