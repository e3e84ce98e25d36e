"""The batch process wired up: what ``python -m services.batch`` runs.

Serves gRPC health (SERVING once its Redis consumer group exists) and Prometheus metrics; on SIGTERM
it stops taking lines, lets running ones finish for ``SHUTDOWN_GRACE_S``, and leaves the rest pending
for another runner.
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import structlog

from services.batch.capacity import Capacity, Headroom
from services.batch.config import BatchSettings
from services.batch.runner import Runner
from services.common import metadata as md
from services.common.pb.meshserve.internal.v1 import router_admin_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.serving import grpc_options, start_server
from services.store.batches import BatchStore
from services.store.connection import redis_from_url

log = structlog.get_logger(__name__)


async def run(settings: BatchSettings) -> None:
    redis = redis_from_url(settings.redis_url, 5.0, read_timeout_s=30.0, client_name="meshserve-batch")
    channels = [grpc.aio.insecure_channel(a, options=grpc_options()) for a in settings.routers()]
    headroom = (
        Headroom(
            max_lines=settings.max_in_flight,
            quiet_s=settings.headroom_quiet_s,
            max_defer_s=settings.headroom_max_defer_s,
            now=time.monotonic(),
        )
        if settings.headroom
        else None
    )
    capacity = Capacity(
        [router_admin_pb2_grpc.RouterAdminStub(c) for c in channels],
        ((md.INTERNAL_TOKEN, settings.internal_token),),
        max_in_flight=settings.max_in_flight,
        reserve_slots=settings.reserve_slots,
        poll_s=settings.capacity_poll_s,
        busy_poll_s=settings.capacity_busy_poll_s,
        headroom=headroom,
    )
    store = BatchStore(redis)
    runner = Runner(settings, store, [inference_pb2_grpc.InferenceStub(c) for c in channels], capacity)
    await store.ensure_group()
    running = await start_server(settings, register=lambda _server: None, service_names=[])
    work = asyncio.create_task(runner.run())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    done, _ = await asyncio.wait([work, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    if work in done:
        work.result()  # raises what ended it
    log.info("service_draining", grace_s=settings.shutdown_grace_s)
    runner.stop()
    await running.set_serving(False)
    try:
        async with asyncio.timeout(settings.shutdown_grace_s + 2):
            await work
    except TimeoutError:
        work.cancel()
    await running.stop()
    for channel in channels:
        await channel.close()
    await redis.aclose()
    log.info("service_stopped")
