"""The worker's listener for the stream transport (services/common/muxwire.py): the router's streams.

Each connection is one multiplexed call served by :func:`~services.worker.mux.serve_mux`:
streams, cancels, bounds and drain as described there. A connection is
served only after its hello carries the internal token (compared in constant time); a wrong or
missing one is answered with a one-sentence refusal and the connection closes, as the gRPC
interceptor refuses a call without it. The connection's end (the router hung up, or it broke)
cancels every stream on it, as a cancelled call does.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac

import structlog

from services.common.muxwire import HELLO_TIMEOUT_S, MAGIC, FrameProtocol, WireError, messages
from services.common.pb.meshserve.internal.v1 import worker_pb2
from services.worker.mux import Generate, MuxCalls, serve_mux

log = structlog.get_logger(__name__)


class StreamMuxServer:
    """Listens on ``host:port`` (0 picks a free port: :attr:`port`) until :meth:`close`."""

    def __init__(self, generate: Generate, calls: MuxCalls, internal_token: str, max_frame: int) -> None:
        self._generate = generate
        self._calls = calls
        self._token = internal_token.encode()
        self._max_frame = max_frame
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0
        self.connections = 0
        """Connections accepted (whatever their hello) since the start."""
        self._deadline: float | None = None

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._connection, host, port)
        self.port = self._server.sockets[0].getsockname()[1]

    def _connection(self) -> FrameProtocol:
        protocol = FrameProtocol(self._max_frame)
        self.connections += 1
        task = asyncio.get_running_loop().create_task(self._serve(protocol))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

        def hung_up() -> None:  # the router hung up (or the connection broke): its streams are cancelled
            task.cancel()

        protocol.on_lost.append(hung_up)
        return protocol

    async def _serve(self, protocol: FrameProtocol) -> None:
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                hello = await protocol.read()
            if hello is None:
                return
            if not hello.startswith(MAGIC) or not hmac.compare_digest(hello[len(MAGIC) :], self._token):
                log.warning("stream_mux_refused", reason="missing or wrong internal credential")
                protocol.write(b"missing or wrong internal credential: only mesh services may call a worker")
                return
            protocol.write(b"")
            requests = messages(protocol, worker_pb2.MuxRequest)
            async for message in serve_mux(self._generate, requests, calls=self._calls):
                protocol.write(message.SerializeToString())
                await protocol.drain()
        except TimeoutError:
            log.info("stream_mux_hello_timeout")
        except (ConnectionError, WireError) as exc:
            log.info("stream_mux_connection_ended", error=str(exc))
        finally:
            protocol.close()
            if protocol.error is not None and not isinstance(protocol.error, ConnectionError):
                log.info("stream_mux_connection_failed", error=str(protocol.error))

    def close(self, grace_s: float = 0.0) -> None:
        """Accept no more connections; those open may run ``grace_s`` more (a drain ends each once
        its streams have ended), then :meth:`finish` cancels them."""
        if self._server is not None:
            self._server.close()
        if self._deadline is None:
            self._deadline = asyncio.get_running_loop().time() + grace_s

    async def finish(self) -> None:
        """Wait for the open connections until the grace given to :meth:`close` ends, then cancel the rest."""
        self.close()
        assert self._deadline is not None
        tasks = list(self._tasks)
        if tasks:
            timeout = max(0.0, self._deadline - asyncio.get_running_loop().time())
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            for task in pending:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*pending, return_exceptions=True)
