"""The gateway http process wired up: what ``python -m services.gateway.http`` runs.

Settings from ``MESHSERVE_GATEWAY_HTTP_*``. Logs ``service_started`` with the bound HTTP port (port 0
picks one) and the Prometheus port (``METRICS_PORT``; -1 = none), serves ``GET /healthz`` for Envoy's
health checks, drains on SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal

import grpc
import structlog
from aiohttp import web

from services.common.grpc_compat import patch_grpc_aio
from services.common.metrics import start_metrics_server
from services.common.pb.meshserve.v1 import batch_pb2_grpc, inference_pb2_grpc
from services.common.serving import grpc_options
from services.gateway.http.app import build_app
from services.gateway.http.config import HttpAdapterSettings
from services.store.responses import ResponseStore

log = structlog.get_logger(__name__)

MAX_HEADER_BYTES = 64 * 1024
"""Longest request line / header field the adapter parses (Envoy's header limit is 60 KiB in all)."""


async def serve(settings: HttpAdapterSettings) -> tuple[web.AppRunner, int, grpc.aio.Channel]:
    """Start the adapter; returns the runner (``cleanup()`` stops it), the bound port and the channel."""
    # The adapter writes a Chat turn right after opening the call; when the gateway refuses the
    # caller at once (401), an unpatched grpc.aio may replace that status by INTERNAL (grpc#36066),
    # which came out as HTTP 500 once in 1,513 header-fuzz cases (docs/fuzz.md).
    patch_grpc_aio()
    channel = grpc.aio.insecure_channel(settings.gateway_address, options=grpc_options())
    store = None
    if settings.redis_url:
        store = ResponseStore.from_url(
            settings.redis_url, ttl_s=settings.responses_ttl_s, timeout_s=settings.redis_timeout_s
        )
    app = build_app(
        inference_pb2_grpc.InferenceStub(channel),
        settings.max_body_bytes,
        store,
        batch_pb2_grpc.BatchesStub(channel),
        settings.max_file_bytes,
    )
    # handler_cancellation: a client that hangs up cancels its handler, hence the gRPC call upstream.
    # Header limits above Envoy's (60 KiB for all headers): Envoy rejects oversized headers with 431;
    # with aiohttp's 8 KiB default, a 9-60 KiB header passed Envoy and made aiohttp log a traceback.
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        max_line_size=MAX_HEADER_BYTES,
        max_field_size=MAX_HEADER_BYTES,
        shutdown_timeout=settings.shutdown_grace_s,  # on the runner: TCPSite's is deprecated (a warning)
    )
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    port = int(sockets[0].getsockname()[1]) if sockets else settings.port
    metrics_port = start_metrics_server(settings.metrics_port, settings.host)
    log.info(
        "service_started", host=settings.host, port=port, metrics_port=metrics_port, gateway=settings.gateway_address
    )
    return runner, port, channel


async def run(settings: HttpAdapterSettings) -> None:
    runner, _port, channel = await serve(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("service_draining", grace_s=settings.shutdown_grace_s)
    await runner.cleanup()
    await channel.close()
    log.info("service_stopped")
