"""Eval process: settings → database → benchmark catalog and runner → service → servers + run worker."""

from __future__ import annotations

import asyncio
from pathlib import Path

from forge.eval.v1 import eval_pb2, eval_pb2_grpc

from forge_eval.api import EvalApi
from forge_eval.config import EvalSettings
from forge_eval.service import EvalService
from forge_eval.spec import BenchmarkCatalog, resolve_data_path
from forge_eval.task_runner import TaskSuiteRunner
from forge_eval.tasks import DataRoots
from forge_kit.app import ServiceApp


async def main() -> None:
    settings = EvalSettings()
    app = ServiceApp(settings)
    db = await app.open_database("eval.db", Path(__file__).parent / "migrations")
    relay = app.enable_outbox()
    benchmarks = resolve_data_path(settings.benchmarks_dir)
    runner = TaskSuiteRunner(
        DataRoots(benchmarks, resolve_data_path(settings.corpora_dir)),
        cache_path=Path(settings.response_cache_path) if settings.response_cache_path else None,
        token=settings.inference_gateway_token.get_secret_value(),
        timeout_s=settings.request_timeout_s,
        batch_size=settings.request_batch_size,
        concurrency=settings.request_concurrency,
    )
    service = EvalService(
        db,
        BenchmarkCatalog(benchmarks),
        runner,
        default_endpoint=settings.inference_gateway_url,
        producer=app.name,
        on_commit=relay.wake if relay else lambda: None,
        run_concurrency=settings.run_concurrency,
    )
    app.add_background(service.run_worker)
    app.log.info("eval.benchmarks", root=str(benchmarks), suites=BenchmarkCatalog(benchmarks).suites())
    api = EvalApi(service, max_page_size=settings.max_page_size)
    await app.run(
        register=[lambda server: eval_pb2_grpc.add_EvalServiceServicer_to_server(api, server)],
        service_names=[eval_pb2.DESCRIPTOR.services_by_name["EvalService"].full_name],
    )


if __name__ == "__main__":
    asyncio.run(main())
