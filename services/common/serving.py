"""Start a grpc.aio server with health, reflection, interceptors and graceful shutdown.

Usage in a service's ``__main__``::

    server = await start_server(settings, register=lambda s: add_XServicer_to_server(svc, s),
                                service_names=[SERVICE_NAME])
    await server.serve_until_signal()

Shutdown (SIGTERM/SIGINT): health goes NOT_SERVING, in-flight streams get ``shutdown_grace_s`` to
finish, then the server stops.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import tracing
from services.common.config import ServiceSettings
from services.common.errors import ConfigError
from services.common.grpc_compat import patch_grpc_aio
from services.common.interceptors import ErrorInterceptor, InternalAuthInterceptor
from services.common.logging import quiet_grpc_decode_errors
from services.common.metrics import start_metrics_server

log = structlog.get_logger(__name__)

MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def _env_name(settings: ServiceSettings, name: str) -> str:
    """The environment variable that sets ``name`` of this service (e.g. MESHSERVE_GATEWAY_PORT)."""
    return f"{settings.model_config.get('env_prefix', '')}{name}".upper()


@dataclass
class RunningServer:
    """A started server: its bound port, health servicer and shutdown hooks."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    service_names: Sequence[str]
    grace_s: float
    metrics_port: int | None = None
    on_stop: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    stopping: bool = False
    """Set by :meth:`stop`: health stays NOT_SERVING from then on, whatever asks for SERVING."""

    async def set_serving(self, serving: bool) -> None:
        if serving and self.stopping:
            return
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self) -> None:
        """Graceful stop: NOT_SERVING, drain for ``grace_s``, run the stop hooks."""
        self.stopping = True
        await self.set_serving(False)
        log.info("service_draining", grace_s=self.grace_s)
        await self.server.stop(self.grace_s)
        for hook in self.on_stop:
            await hook()
        log.info("service_stopped")

    async def serve_until_signal(self) -> None:
        """Block until SIGTERM/SIGINT, then stop gracefully."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await self.stop()


def grpc_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
    ]


async def start_server(
    settings: ServiceSettings,
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    *,
    internal: bool = False,
    serving: bool = True,
    announce: bool = True,
) -> RunningServer:
    """Build, bind and start the server. ``internal`` adds the internal-credential check.

    With ``serving=False`` health stays NOT_SERVING until the caller calls ``set_serving(True)``
    (e.g. after a warm-up). ``announce=False`` logs ``internal_server_started`` instead of
    ``service_started`` (a second server in one process: launchers take the first
    ``service_started`` line as the process's port).
    """
    patch_grpc_aio()  # this process's own outgoing streams report the peer's status (grpc#36066)
    quiet_grpc_decode_errors()  # metadata that is not UTF-8 is refused, not logged as a traceback
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if internal:
        interceptors.append(InternalAuthInterceptor(settings.internal_token))
    interceptors.append(ErrorInterceptor())
    # Tracing (MESHSERVE_TRACING_*) is set up once per process; an in-process test's setup is kept.
    provider = None if tracing.enabled() else tracing.setup_tracing(settings.service)
    if tracing.enabled():
        from services.common.tracing_interceptor import TracingInterceptor

        interceptors.append(TracingInterceptor(public=not internal))  # public: sampling is decided here
    server = grpc.aio.server(interceptors=interceptors, options=grpc_options())
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    address = f"{settings.host}:{settings.port}"
    try:
        port = server.add_insecure_port(address)
    except RuntimeError:  # grpc's "Failed to bind to address ..."; its log line above says why
        port = 0
    if port == 0:
        raise ConfigError(
            f"cannot listen on {address}: the port is in use (or the host is not this machine's); "
            f"set {_env_name(settings, 'port')} to a free port (0 picks one)"
        )
    await server.start()
    running = RunningServer(server, port, health_servicer, service_names, settings.shutdown_grace_s)
    try:
        running.metrics_port = start_metrics_server(settings.metrics_port, settings.host)
    except OSError as exc:
        await server.stop(None)
        raise ConfigError(
            f"cannot serve /metrics on {settings.host}:{settings.metrics_port} ({exc.strerror or exc}); "
            f"set {_env_name(settings, 'metrics_port')} to a free port (0 picks one, -1 turns it off)"
        ) from None
    if provider is not None:

        async def flush_spans() -> None:
            # Exports what is left (may wait on a collector), then tracing is off for this process.
            await asyncio.to_thread(tracing.reset_tracing)

        running.on_stop.append(flush_spans)
    await running.set_serving(serving)
    if settings.dev_token_exposed:
        log.warning(
            "internal_token_is_the_dev_default",
            host=settings.host,
            fix=f"set MESHSERVE_{settings.service.upper()}_INTERNAL_TOKEN (the same secret on every service)",
        )
    event = "service_started" if announce else "internal_server_started"
    log.info(event, service=settings.service, host=settings.host, port=port, metrics_port=running.metrics_port)
    return running
