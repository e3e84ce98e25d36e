"""The cheapest possible gRPC hop, as a floor for the gateway and router: relay Worker.Generate as is.

``python -m benchmarks.gateway.bare_relay`` (env ``MESHSERVE_BARE_RELAY_UPSTREAM`` = host:port): a grpc.aio
server with no interceptors, no auth, no metrics, no logging per call, whose bidi ``Generate`` opens
the same call upstream and copies messages both ways. Two of these chained in front of a worker
cost what two Python gRPC hops cost at the least, on this machine; :mod:`benchmarks.gateway.hops` reports
it next to the real gateway + router. Listens on 127.0.0.1 and logs ``service_started`` like the
services do, so the launcher finds its port.

``MESHSERVE_BARE_RELAY_SYNC=1`` serves the same relay with grpc's synchronous API instead (a thread
per call, blocking reads and writes, no event loop): the experiment of whether Python gRPC hops
can get under the grpc.aio floor (``MESHSERVE_BARE_RELAY_SYNC=1 python -m benchmarks.gateway.hops`` starts
both relays that way; docs/benchmarks/hops.md has the result).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from services.common.config import DEFAULT_INTERNAL_TOKEN
from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc

_META = (("x-meshserve-internal-token", DEFAULT_INTERNAL_TOKEN),)


class Relay(worker_pb2_grpc.WorkerServicer):
    def __init__(self, upstream: worker_pb2_grpc.WorkerStub) -> None:
        self._upstream = upstream

    async def Generate(
        self, request_iterator: AsyncIterator[worker_pb2.WorkerRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.WorkerResponse]:
        call = self._upstream.Generate(metadata=_META)

        async def pump() -> None:
            async for request in request_iterator:
                await call.write(request)
            await call.done_writing()

        task = asyncio.create_task(pump())
        try:
            async for frame in call:
                yield frame
        finally:
            task.cancel()
            call.cancel()
            with contextlib.suppress(BaseException):
                await task


async def _main() -> None:
    upstream = os.environ["MESHSERVE_BARE_RELAY_UPSTREAM"]
    options = [tuple(o) for o in json.loads(os.environ.get("MESHSERVE_BARE_RELAY_OPTIONS", "[]"))]
    channel = grpc.aio.insecure_channel(upstream, options=options)
    server = grpc.aio.server(options=options)
    relay = Relay(worker_pb2_grpc.WorkerStub(channel))  # type: ignore[abstract]  # relays Generate only
    worker_pb2_grpc.add_WorkerServicer_to_server(relay, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(json.dumps({"event": "service_started", "port": port}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0)
    await channel.close()


class SyncRelay(worker_pb2_grpc.WorkerServicer):
    """The same relay on grpc's synchronous API: the handler thread reads upstream, a thread pumps up."""

    def __init__(self, upstream: worker_pb2_grpc.WorkerStub) -> None:
        self._upstream = upstream

    def Generate(
        self, request_iterator: Iterator[worker_pb2.WorkerRequest], context: grpc.ServicerContext
    ) -> Iterator[worker_pb2.WorkerResponse]:  # type: ignore[override]
        call = self._upstream.Generate(request_iterator, metadata=_META)  # grpc pumps requests in its own thread
        context.add_callback(call.cancel)
        yield from call


def _sync_main() -> None:
    upstream = os.environ["MESHSERVE_BARE_RELAY_UPSTREAM"]
    options = [tuple(o) for o in json.loads(os.environ.get("MESHSERVE_BARE_RELAY_OPTIONS", "[]"))]
    channel = grpc.insecure_channel(upstream, options=options)
    server = grpc.server(ThreadPoolExecutor(max_workers=64), options=options)
    worker_pb2_grpc.add_WorkerServicer_to_server(SyncRelay(worker_pb2_grpc.WorkerStub(channel)), server)  # type: ignore[abstract]  # relays Generate only
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(json.dumps({"event": "service_started", "port": port}), flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(0)
    channel.close()


if __name__ == "__main__":
    if os.environ.get("MESHSERVE_BARE_RELAY_SYNC"):
        _sync_main()
        sys.exit(0)
    if os.environ.get("MESHSERVE_BARE_RELAY_UVLOOP"):
        import uvloop

        uvloop.install()
    asyncio.run(_main())
    sys.exit(0)
