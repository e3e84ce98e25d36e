"""Worker bootstrap shared by the tiers: build the runner and servicer, serve, warm up, drain.

In-process (tests, launchers)::

    worker = await start_worker(settings, engine, tier="edge")
    ... worker.port ...
    await worker.stop()

As a process, ``run_worker_process(SettingsClass, build_engine, tier=...)`` is the whole ``__main__``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import structlog

from services.common import metrics
from services.common.errors import ConfigError
from services.common.logging import configure_logging
from services.common.pb.meshserve.internal.v1 import worker_pb2
from services.common.serving import RunningServer, start_server
from services.common.settings import load_settings
from services.common.worker.runner import Runner
from services.common.worker.servicer import WorkerServicer
from services.common.worker.settings import WorkerSettings
from services.common.worker.types import Engine

log = structlog.get_logger(__name__)

WORKER_SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
W = TypeVar("W", bound=WorkerSettings)


@dataclass
class RunningWorker:
    """A serving worker: its server (port, health), servicer and runner."""

    server: RunningServer
    servicer: WorkerServicer
    runner: Runner

    @property
    def port(self) -> int:
        return self.server.port

    async def stop(self) -> None:
        """Graceful: NOT_SERVING, let streams finish for the grace period, cancel the rest."""
        await self.server.stop()

    async def serve_until_signal(self) -> None:
        await self.server.serve_until_signal()


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
    )
    servicer = WorkerServicer(
        runner,
        service=type(settings).service,
        tier=tier,
        worker_id=settings.resolved_worker_id(),
        default_max_tokens=settings.default_max_tokens,
    )
    server = await start_server(settings, servicer.register, [WORKER_SERVICE_NAME], internal=True, serving=False)
    admission = runner.admission
    metrics.track_load(type(settings).service, tier, queued=lambda: admission.queued, active=lambda: admission.active)

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
    log.info("worker_ready", worker_id=servicer.worker_id, tier=tier, model=info.model_id, port=server.port)
    return RunningWorker(server, servicer, runner)


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

    asyncio.run(main())
