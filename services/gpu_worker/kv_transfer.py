"""Worker.ImportKV / Worker.ExportKV on the cloud engine: a prefix's KV blocks between Redis and the local cache.

* Import: the chain keys of the prefix's full blocks; if the local prefix cache lacks some, the
  longest stored chain is read from Redis on the calling thread (``RedisPrefixCache.load``, the read
  admission does, bounded by the store's timeout) and handed to the engine loop thread, which writes
  the missing blocks between two steps and caches them unreferenced (``Scheduler.import_blocks``):
  the next request with that prefix reuses them as local blocks, and the worker's load reports list
  the prefix (``hot_prefix_blocks``), so prefix-aware routing prefers this replica for it. A miss
  because Redis is down is told apart from a plain miss by one PING (``redis_unavailable``); the
  import is then 0, not an error.
* Export: the leading run of the prefix's blocks held locally is referenced (so nothing evicts or
  rewrites it), read (every KV head: under tensor parallelism gathered from the ranks, as the
  export on finish does), released, and written to Redis synchronously (``RedisPrefixCache.write``).

The functions take the engine as a :class:`PrefixHost` (declared here, met by ``CloudEngine``), so
this module depends on the block manager, scheduler and Redis cache it drives, never on the engine
that calls it.

Tensor parallelism needs nothing more: block reads and writes go through the engine's ``kv_io``
(tp_kv.py), the same path as admission imports and exports on finish. Engines without a Redis prefix
cache (prefix cache off, no Redis URL) refuse with FailedPrecondition.
"""

from __future__ import annotations

from typing import Protocol

from prometheus_client import Counter
from torch import Tensor

from services.common.errors import FailedPrecondition
from services.gpu_worker.blocks import BlockManager
from services.gpu_worker.model import KVCache
from services.gpu_worker.prefix import RedisPrefixCache, chain_keys
from services.gpu_worker.scheduler import Scheduler
from services.gpu_worker.tp_kv import KVBlockIO
from services.store.kv_blocks import KVContext
from services.worker.kv_transfer import KVExport, KVImport, KVPrefix

KV_TRANSFER_BLOCKS = Counter(
    "meshserve_kv_transfer_blocks_total",
    "KV prefix blocks moved by the Worker.ImportKV (Redis -> this worker) and Worker.ExportKV (this worker -> "
    "Redis) calls; the automatic import on admission and export on finish are not counted here.",
    ["direction"],
)


class PrefixHost(Protocol):
    """What the transfers need of an engine: its paged KV, block manager, scheduler and Redis cache."""

    prefix_cache: bool
    redis: RedisPrefixCache | None
    block_tokens: int
    blocks: BlockManager
    scheduler: Scheduler
    kv_io: KVBlockIO
    cache: KVCache

    def kv_context(self, tenant: str, shareable: bool = False) -> KVContext:
        """The key context (model version, tenant salt) of the tenant's blocks."""
        ...

    def checked_blocks(self, blocks: list[Tensor]) -> list[Tensor]:
        """The leading blocks of the engine's layout, in its KV dtype."""
        ...

    def remember_prefix(self, chain: list[str]) -> None:
        """List the chain first in the engine's load reports."""
        ...

    def wake(self) -> None:
        """Make the engine loop look for work again."""
        ...


def _redis(engine: PrefixHost) -> RedisPrefixCache:
    if not engine.prefix_cache:
        raise FailedPrecondition(
            "this cloud worker runs with its prefix cache off; start it with MESHSERVE_GPU_WORKER_PREFIX_CACHE=true "
            "and MESHSERVE_GPU_WORKER_REDIS_URL set to import or export KV"
        )
    if engine.redis is None:
        raise FailedPrecondition(
            "this cloud worker has no Redis for its KV prefix cache; start it with MESHSERVE_GPU_WORKER_REDIS_URL "
            "set to import or export KV"
        )
    return engine.redis


def _scope(engine: PrefixHost, prefix: KVPrefix) -> tuple[RedisPrefixCache, KVContext, int, list[int], list[str]]:
    """The engine's Redis, the prefix's key context, block size, full-block token ids and chain keys."""
    redis = _redis(engine)
    ctx = engine.kv_context(prefix.tenant, prefix.shareable)
    bt = engine.block_tokens
    ids = list(prefix.token_ids[: len(prefix.token_ids) // bt * bt])
    return redis, ctx, bt, ids, chain_keys(ctx, bt, ids)


def import_prefix(engine: PrefixHost, prefix: KVPrefix) -> KVImport:
    """Load the prefix's blocks missing locally from Redis into the local prefix cache (blocking)."""
    redis, ctx, bt, ids, keys = _scope(engine, prefix)
    with engine.blocks.lock:
        held = engine.blocks.cached_prefix(keys)
    imported, unavailable = 0, False
    if held < len(keys):
        loaded = engine.checked_blocks(redis.load(ctx, ids))
        if len(loaded) > held:
            imported = engine.scheduler.import_blocks(keys[: len(loaded)], loaded)
        elif not loaded:
            unavailable = not redis.reachable()
    if held + imported:  # load reports list the prefix, so prefix-aware routing sends it here
        engine.remember_prefix(keys[: held + imported])
    KV_TRANSFER_BLOCKS.labels("import").inc(imported)
    return KVImport(bt, len(prefix.token_ids), len(keys), held, imported, unavailable)


def export_prefix(engine: PrefixHost, prefix: KVPrefix) -> KVExport:
    """Write the leading run of the prefix's locally held blocks to Redis and wait (blocking)."""
    redis, ctx, bt, ids, keys = _scope(engine, prefix)
    with engine.blocks.lock:
        blocks = engine.blocks.acquire_prefix(keys)  # referenced: nothing evicts or rewrites them
    try:
        data = engine.kv_io.read_blocks(engine.cache, blocks) if blocks else []
    finally:
        with engine.blocks.lock:
            engine.blocks.release(blocks)
        engine.wake()  # admissions waiting for blocks may fit now
    written = redis.write(ctx, ids[: len(data) * bt], data) if data else 0
    KV_TRANSFER_BLOCKS.labels("export").inc(written)
    return KVExport(bt, len(prefix.token_ids), len(keys), written, len(keys) - len(blocks))
