"""Worker bootstrap shared by the tiers: build the runner and servicer, serve, warm up, drain.

In-process (tests, launchers)::

    worker = await start_worker(settings, engine, tier="edge")
    ... worker.port ...
    await worker.stop()

As a process, ``run_worker_process(SettingsClass, build_engine, tier=...)`` is the whole ``__main__``.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import structlog

from services.common import metrics
from services.common.config import load_settings
from services.common.errors import ConfigError
from services.common.logging import configure_logging
from services.common.pb.meshserve.internal.v1 import worker_pb2
from services.common.serving import MAX_MESSAGE_BYTES, RunningServer, start_server
from services.worker.config import WorkerSettings
from services.worker.heartbeat import Heartbeater
from services.worker.mux_tcp import StreamMuxServer
from services.worker.report import LoadReporter, PrefixHasher
from services.worker.runner import Runner
from services.worker.servicer import _TIERS, WorkerServicer
from services.worker.types import Engine

log = structlog.get_logger(__name__)

WORKER_SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
W = TypeVar("W", bound=WorkerSettings)


@dataclass
class RunningWorker:
    """A serving worker: its server (port, health), servicer and runner."""

    server: RunningServer
    servicer: WorkerServicer
    runner: Runner
    heartbeater: Heartbeater | None = None
    """Set when the worker registers itself with routers (``router_address``)."""
    stream: StreamMuxServer | None = None
    """The stream transport's listener, where routers send their request streams."""

    @property
    def port(self) -> int:
        return self.server.port

    async def stop(self) -> None:
        """Graceful: tell routers we leave, NOT_SERVING, let streams finish for the grace period, cancel the rest."""
        if self.heartbeater is not None:  # before the drain, so routers stop sending new work at once
            await self.heartbeater.leave()
        self.servicer.mux_calls.drain()  # new multiplexed streams are refused, like new calls
        if self.stream is not None:  # its streams drain alongside the gRPC calls (see start_worker)
            self.stream.close(self.server.grace_s)
        await self.server.stop()

    async def serve_until_signal(self) -> None:
        """Block until SIGTERM/SIGINT, then :meth:`stop`."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await self.stop()


async def start_worker(settings: WorkerSettings, engine: Engine, *, tier: str) -> RunningWorker:
    """Serve ``engine`` on ``settings.host:port`` (internal credential required).

    Health is NOT_SERVING until the optional warm-up has run, then SERVING.
    """
    runner = Runner(
        engine,
        max_active=settings.max_active_sequences,
        max_queue=settings.max_queue,
        name=type(settings).service,
        max_open_chats=settings.max_open_chats,
        chat_idle_timeout_s=settings.chat_idle_timeout_s,
        keepalive_s=settings.queued_keepalive_s,
        flush=settings.flush_window(),
        sleep_margin_bytes=settings.sleep_memory_margin_bytes,
    )
    runner.start()  # the engine loop runs from the start (a Worker.ImportKV may come before any turn)
    hasher = PrefixHasher(settings.model_id, settings.resolved_model_version(), settings.prefix_block_tokens)
    servicer = WorkerServicer(
        runner,
        service=type(settings).service,
        tier=tier,
        worker_id=settings.resolved_worker_id(),
        default_max_tokens=settings.default_max_tokens,
        reporter=LoadReporter(runner, hasher, max_hot_blocks=settings.max_hot_blocks),
        first_token_delay_s=settings.fault_first_token_delay_s,
    )
    server = await start_server(settings, servicer.register, [WORKER_SERVICE_NAME], internal=True, serving=False)
    admission = runner.admission
    metrics.track_load(type(settings).service, tier, queued=lambda: admission.queued, active=lambda: admission.active)

    stream = StreamMuxServer(servicer.Generate, servicer.mux_calls, settings.internal_token, MAX_MESSAGE_BYTES)
    try:
        await stream.start(settings.host, settings.stream_port)
    except OSError as exc:
        await server.stop()
        raise ConfigError(
            f"cannot listen on {settings.host}:{settings.stream_port} for the stream transport "
            f"({exc.strerror or exc}); set MESHSERVE_{type(settings).service.upper()}_STREAM_PORT to a free "
            "port (0 picks one)"
        ) from None
    servicer.stream_port = stream.port
    # Its streams finish within the grace the gRPC calls get (from RunningWorker.stop), then are
    # cancelled; before the engine closes.
    server.on_stop.append(stream.finish)
    server.on_stop.append(runner.aclose)
    sweeper = asyncio.create_task(runner.sweep_sessions_forever())

    async def stop_sweeper() -> None:
        sweeper.cancel()

    server.on_stop.append(stop_sweeper)
    servicer.worker_id = settings.resolved_worker_id(server.port)
    try:
        if settings.warmup:
            await runner.warmup()
    except BaseException:
        await server.stop()
        raise
    await server.set_serving(True)
    info = engine.info
    log.info(
        "worker_ready",
        worker_id=servicer.worker_id,
        tier=tier,
        model=info.model_id,
        port=server.port,
        stream_port=servicer.stream_port,
    )
    if settings.fault_first_token_delay_s:  # a test setting: say so, in case it was left on
        log.warning("fault_injection_on", first_token_delay_s=settings.fault_first_token_delay_s)
    heartbeater = None
    if settings.router_address:  # registered only once it serves: the router probes health at once
        heartbeater = Heartbeater(
            settings.router_address,
            address=settings.resolved_advertise_address(server.port),
            tier=_TIERS[tier],
            stats=servicer.stats,
            internal_token=settings.internal_token,
            interval_s=settings.heartbeat_interval_s,
            timeout_s=settings.heartbeat_timeout_s,
            resolve=settings.router_resolve,
        )
        heartbeater.start()
        server.on_stop.append(heartbeater.close)
        runner.model.on_change.append(lambda _state: heartbeater.beat_now())  # routers learn it at once
    return RunningWorker(server, servicer, runner, heartbeater, stream)


def run_worker_process(settings_cls: type[W], build_engine: Callable[[W], Engine], *, tier: str) -> None:
    """``python -m services.<tier>``: settings, logging, model load, serve until SIGTERM/SIGINT."""
    try:
        settings = load_settings(settings_cls)
    except ConfigError as exc:
        configure_logging(settings_cls.service)
        log.error("config_error", error=str(exc))
        raise SystemExit(2) from None
    configure_logging(settings_cls.service, settings.log_level, settings.log_json)
    log.info("model_loading", model=settings.model_id)
    try:
        engine = build_engine(settings)
    except ConfigError as exc:
        log.error("config_error", error=str(exc))
        raise SystemExit(2) from None

    async def main() -> None:
        worker = await start_worker(settings, engine, tier=tier)
        await worker.serve_until_signal()

    try:
        asyncio.run(main())
    except ConfigError as exc:  # settings read when serving starts (MESHSERVE_TRACING_*)
        log.error("config_error", error=str(exc))
        raise SystemExit(2) from None
