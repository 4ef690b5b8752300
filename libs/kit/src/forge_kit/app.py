"""The common wiring of a service process, so each ``__main__.py`` stays a few lines.

``ServiceApp`` opens (and migrates) the service's database, creates the outbox relay when events
are enabled, starts the gRPC and HTTP servers with the kit's defaults, and runs until SIGTERM.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Coroutine, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
from fastapi import FastAPI
from forge.events.v1 import events_pb2_grpc

from forge_kit import audit
from forge_kit.consumer import EventConsumer, Handler
from forge_kit.db import Database
from forge_kit.eventauth import EventSigner
from forge_kit.eventlog import SERVICE_NAME as EVENT_LOG_SERVICE
from forge_kit.eventlog import EventLogApi
from forge_kit.events import KafkaPublisher
from forge_kit.grpckit import Authenticator, serve, set_default_client_tls
from forge_kit.http import HttpServer, make_app
from forge_kit.logs import configure_logging
from forge_kit.outbox import MarkPublished, OutboxRelay
from forge_kit.runtime import ServiceParts, run_forever
from forge_kit.settings import ServiceSettings, default_secrets


def refuse_default_secrets(settings: ServiceSettings) -> None:
    """Exit with a clear message when ``settings`` hold no service token or a known default
    secret: a platform started with a credential everyone knows is open to everyone."""
    problems = default_secrets(settings)
    if problems:
        prefix = str(settings.model_config.get("env_prefix") or "")
        raise SystemExit(
            f"{settings.service_name} refuses to start: {'; '.join(problems)}. Set the secrets in the "
            f"environment ({prefix}<SETTING>); `forge up` and `make secrets` generate them."
        )


class ServiceApp:
    """Builds the shared parts of one service from its settings."""

    def __init__(self, settings: ServiceSettings) -> None:
        self.settings = settings
        self.name = settings.service_name
        self.log = configure_logging(self.name, settings.log_level, settings.log_json)
        refuse_default_secrets(settings)
        set_default_client_tls(settings.tls())
        self.db: Database | None = None
        self.publisher: KafkaPublisher | None = None
        self.relay: OutboxRelay | None = None
        self._serves_event_log = False
        self._background: list[Callable[[], Coroutine[Any, Any, None]]] = []
        self._on_stop: list[Callable[[], Awaitable[None]]] = []

    @property
    def token(self) -> str:
        return self.settings.auth_token.get_secret_value()

    async def open_database(self, filename: str, migrations_dir: Path) -> Database:
        """Open the service database (SQLite file by default) and migrate it to head."""
        self.db = Database(self.settings.sqlite_url(filename))
        await self.db.migrate(migrations_dir)
        self._on_stop.append(self.db.dispose)
        return self.db

    def enable_outbox(
        self,
        *,
        batch_size: int = 100,
        min_interval_s: float = 0.0,
        mark_published: MarkPublished | None = None,
    ) -> OutboxRelay | None:
        """Relay the database's outbox to Kafka in the background (when Kafka is enabled) and
        serve the EventLogService, from which consumers catch up on the outbox. The arguments
        tune the relay (:class:`forge_kit.outbox.OutboxRelay`)."""
        if self.db is None:
            raise RuntimeError("open_database() first")
        self._serves_event_log = True
        if not self.settings.kafka_enabled:
            return None
        self.publisher = KafkaPublisher(self.settings.kafka_bootstrap, auth=self.settings.kafka_auth())
        self.relay = OutboxRelay(
            self.db,
            self.publisher,
            signer=self.require_signer(),
            batch_size=batch_size,
            min_interval_s=min_interval_s,
            mark_published=mark_published,
        )
        self._background.append(self.relay.run)
        self._on_stop.append(self.publisher.close)
        return self.relay

    def require_signer(self) -> EventSigner:
        """The service's event signer; a publishing service without a signing key cannot start."""
        signer = self.settings.event_signer()
        if signer is None:
            prefix = str(self.settings.model_config.get("env_prefix") or "")
            raise RuntimeError(
                f"{self.name} publishes events but has no signing key: set {prefix}EVENT_SIGNING_KEY "
                "(`forge up` and `make secrets` generate one per service)"
            )
        return signer

    def event_consumer(
        self,
        *,
        group_id: str,
        topics: Sequence[str],
        handler: Handler,
        sources: Mapping[str, Collection[str]] | None = None,
        **options: int | str,
    ) -> EventConsumer:
        """An :class:`EventConsumer` wired to this service's broker, credentials and verify keys,
        run in the background for the life of the process."""
        if self.db is None:
            raise RuntimeError("open_database() first")
        consumer = EventConsumer(
            self.db,
            bootstrap=self.settings.kafka_bootstrap,
            group_id=group_id,
            topics=topics,
            handler=handler,
            verifier=self.settings.event_verifier(),
            sources=sources,
            auth=self.settings.kafka_auth(),
            **options,  # type: ignore[arg-type]
        )
        self.add_background(consumer.run)
        self.add_on_stop(consumer.stop)
        return consumer

    def add_background(self, factory: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``factory()`` as a task for the life of the process; its failure stops the process."""
        self._background.append(factory)

    def add_on_stop(self, hook: Callable[[], Awaitable[None]]) -> None:
        self._on_stop.append(hook)

    def http_app(self, **kwargs: object) -> FastAPI:
        """The service's FastAPI app with probes; readiness includes the database when open."""
        checks = {}
        if self.db is not None:
            checks["database"] = self.db.ping
        return make_app(self.name, readiness=checks, **kwargs)

    async def run(
        self,
        *,
        register: Sequence[Callable[[grpc.aio.Server], None]],
        service_names: Iterable[str],
        http: FastAPI | None = None,
        max_concurrent_rpcs: int | None = None,
        authenticators: Sequence[Authenticator] = (),
    ) -> None:
        """Start both servers and block until the process is told to stop. ``authenticators``
        accept tokens besides the service token (see :class:`forge_kit.grpckit.Principal`).
        Admin actions are audited to ``<data_dir>/audit.jsonl`` (:mod:`forge_kit.audit`)."""
        settings = self.settings
        audit.configure(settings.data_dir)
        register = list(register)
        service_names = list(service_names)
        if self._serves_event_log and self.db is not None:
            # Whoever publishes events lets consumers catch up from its outbox.
            log_api = EventLogApi(self.db, signer=settings.event_signer())
            register.append(
                lambda server: events_pb2_grpc.add_EventLogServiceServicer_to_server(log_api, server)
            )
            service_names.append(EVENT_LOG_SERVICE)
        grpc_server = await serve(
            service=self.name,
            register=register,
            service_names=service_names,
            host=settings.host,
            port=settings.grpc_port,
            token=self.token,
            default_deadline_s=settings.default_deadline_s,
            max_concurrent_rpcs=max_concurrent_rpcs,
            tls=settings.tls(),
            authenticators=authenticators,
            max_receive_bytes=settings.grpc_max_receive_bytes,
        )
        http_server = HttpServer(
            http or self.http_app(),
            settings.host,
            settings.http_port,
            max_body_bytes=settings.http_max_body_bytes,
        )
        await http_server.start()
        await run_forever(
            ServiceParts(
                name=self.name,
                grpc=grpc_server,
                http=http_server,
                background=self._background,
                on_stop=self._on_stop,
            )
        )
