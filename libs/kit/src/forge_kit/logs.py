"""Structured logging: one JSON object per line, with the service name bound."""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Mapping
from typing import Any

import structlog

SECRET_KEYS = re.compile(r"(token|password|secret|api_?key|authorization|credential)", re.IGNORECASE)
REDACTED = "[redacted]"


def redact(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with every value under a secret-looking key (token, password, api key, …)
    replaced by ``[redacted]``, nested mappings included."""
    return {
        key: REDACTED
        if SECRET_KEYS.search(str(key))
        else (redact(value) if isinstance(value, Mapping) else value)
        for key, value in values.items()
    }


def _redact_event(
    _logger: object, _method: str, event: structlog.types.EventDict
) -> structlog.types.EventDict:
    """structlog processor: secrets passed as log fields never reach the output."""
    return redact(event)


def configure_logging(service: str, level: str = "INFO", json: bool = True) -> structlog.BoundLogger:
    """Route stdlib and structlog output through one renderer; return the service's logger."""
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        _redact_event,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(sys.stderr)
    # Standard-library records (uvicorn's "Exception in ASGI application", asyncio's) carry the
    # exception as an ``exc_info`` tuple: rendered as a traceback text, not the tuple's repr.
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[
                *shared,
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
            foreign_pre_chain=shared,
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # uvicorn's own loggers may have been given handlers of their own (its default log config
    # does that, and stops propagation): their records, 500s included, go through ours instead.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    for noisy in ("aiokafka", "kafka", "temporalio.activity", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    return structlog.get_logger(service=service)  # type: ignore[no-any-return]
