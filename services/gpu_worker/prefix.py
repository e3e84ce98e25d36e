"""The engine's side of the shared KV prefix cache: chain keys, and Redis I/O from worker threads.

Keys come from services.store (``KVBlockStore.keys`` / services.store.keys.kv_block_keys): the same chain key
names a block in the local LRU and in Redis, so a prefix computed on one replica (or before a
restart) is found by any other. ``services.store.kv_blocks`` is asyncio code; the engine runs in threads,
so :class:`RedisPrefixCache` owns a private event loop thread and its own Redis client. Loads block
the calling thread (the engine's I/O thread, or a Worker.ImportKV call; bounded by the store's
timeout), stores are fire-and-forget, at most
``max_pending`` at a time (each holds its blocks' tensors until Redis answers): a store beyond that is
skipped (counted in ``skipped``), so a slow Redis cannot make the worker hold KV copies without bound.
``write`` (Worker.ExportKV) is the one store that waits for Redis and says when Redis is down.
Every failure is a miss (the store fails open): a Redis outage never fails a request.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import structlog
from torch import Tensor

from services.common.errors import Unavailable
from services.store.connection import redis_from_url
from services.store.guard import Failed, Guard
from services.store.keys import kv_block_keys
from services.store.kv_blocks import KVBlockStore, KVContext

log = structlog.get_logger(__name__)
_WRITE_BYTES = 4 << 20
"""Most value bytes of one synchronous put (``write``)."""


def chain_keys(ctx: KVContext, block_tokens: int, token_ids: Sequence[int]) -> list[str]:
    """Chain keys of the full blocks of ``token_ids`` (services.store.keys' key schema)."""
    return kv_block_keys(
        model_id=ctx.model_id,
        model_version=ctx.model_version,
        tenant=ctx.tenant,
        token_ids=token_ids,
        block_tokens=block_tokens,
        shareable=ctx.shareable,
    )


def key_digest(key: str) -> bytes:
    """The SHA-256 chain hash inside a block key (what load reports list as hot prefix blocks)."""
    return bytes.fromhex(key.rpartition(":e:")[2])


class RedisPrefixCache:
    """KV blocks in Redis through services.store.kv_blocks, callable from any thread."""

    def __init__(
        self,
        url: str,
        *,
        block_tokens: int,
        budget_bytes: int,
        ttl_s: int,
        timeout_s: float,
        max_block_bytes: int,
        max_pending: int = 64,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="gpu-kv-redis", daemon=True)
        self._thread.start()
        self.timeout_s = timeout_s
        self.pending: set[Future[int]] = set()
        self.max_pending = max_pending
        self.skipped = 0
        """Stores skipped because ``max_pending`` were in flight."""

        async def build() -> KVBlockStore:
            guard = Guard(redis_from_url(url, timeout_s), timeout_s=timeout_s, service="gpu_worker")
            return KVBlockStore(
                guard,
                block_tokens=block_tokens,
                ttl_s=ttl_s,
                budget_bytes=budget_bytes,
                max_block_bytes=max_block_bytes,
                timeout_s=timeout_s,
            )

        self.store = asyncio.run_coroutine_threadsafe(build(), self._loop).result()

    def load(self, ctx: KVContext, token_ids: Sequence[int]) -> list[Tensor]:
        """The longest stored chain of blocks for ``token_ids`` (blocking; empty on any problem)."""
        future = asyncio.run_coroutine_threadsafe(self.store.load(ctx, token_ids, as_="torch"), self._loop)
        try:
            return list(future.result(timeout=self.timeout_s * 4 + 1))
        except (FutureTimeout, Exception) as exc:  # fail open: a miss
            future.cancel()
            log.warning("kv_prefix_load_failed", error=type(exc).__name__)
            return []

    def write(self, ctx: KVContext, token_ids: Sequence[int], blocks: Sequence[Tensor]) -> int:
        """Store ``blocks`` as chain positions 0, 1, ... and wait for Redis (Worker.ExportKV).

        Written in puts of at most ``_WRITE_BYTES`` (each bounded by the store's timeout, so a long
        prefix is not one transfer racing one deadline). Returns the leading blocks stored; stops at
        the first put Redis refused part of. Unavailable when Redis could not be written at all.
        """
        stored = 0
        while stored < len(blocks):
            end, size = stored, 0
            while end < len(blocks) and (end == stored or size + blocks[end].nbytes <= _WRITE_BYTES):
                size += blocks[end].nbytes
                end += 1
            chunk = list(blocks[stored:end])
            future = asyncio.run_coroutine_threadsafe(
                self.store.put(ctx, list(token_ids[: end * self.store.block_tokens]), chunk, first_block=stored),
                self._loop,
            )
            try:
                n = future.result(timeout=self.timeout_s * 4 + 1)
            except (FutureTimeout, Exception) as exc:
                future.cancel()
                log.warning("kv_prefix_write_failed", error=type(exc).__name__)
                n = 0
            stored += n
            if n < len(chunk):
                if stored == 0 and not self.reachable():
                    raise Unavailable(
                        "Redis did not take the KV blocks (down, slower than the KV Redis timeout, or its "
                        "circuit breaker is open); retry ExportKV once Redis is back"
                    )
                break
        return stored

    def reachable(self) -> bool:
        """Does Redis answer a PING now (through the store's guard: timeout and circuit breaker)?"""
        future = asyncio.run_coroutine_threadsafe(self.store.guard.run("kv_ping", lambda c: c.ping()), self._loop)
        try:
            return not isinstance(future.result(timeout=self.timeout_s * 4 + 1), Failed)
        except (FutureTimeout, Exception):
            future.cancel()
            return False

    def store_async(self, ctx: KVContext, token_ids: Sequence[int], blocks: Sequence[Tensor], first: int) -> None:
        """Store ``blocks`` as chain positions ``first``, ``first + 1``, ... in the background."""
        if len(self.pending) >= self.max_pending:
            self.skipped += 1
            return
        future = asyncio.run_coroutine_threadsafe(
            self.store.put(ctx, list(token_ids), list(blocks), first_block=first), self._loop
        )
        self.pending.add(future)
        future.add_done_callback(self._stored)

    def _stored(self, future: Future[int]) -> None:
        self.pending.discard(future)
        if not future.cancelled() and future.exception() is not None:
            log.warning("kv_prefix_store_failed", error=type(future.exception()).__name__)

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait (bounded) for the stores in flight (tests, shutdown)."""
        for future in list(self.pending):
            try:
                future.result(timeout=timeout_s)
            except Exception:  # already logged by _stored
                pass

    def close(self) -> None:
        self.flush()

        async def shutdown() -> None:
            await self.store.guard.close()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=5)
        except Exception as exc:
            log.warning("kv_prefix_close_failed", error=type(exc).__name__)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()
