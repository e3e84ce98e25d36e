"""RedisPrefixCache: stores in flight are bounded (each holds its KV blocks until Redis answers)."""

from __future__ import annotations

import socket

import torch

from services.gpu_worker.prefix import RedisPrefixCache
from services.store.kv_blocks import KVContext


def test_stores_beyond_max_pending_are_skipped_while_redis_does_not_answer() -> None:
    silent = socket.socket()  # accepts connections (the kernel's backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(128)
    port = silent.getsockname()[1]
    cache = RedisPrefixCache(
        f"redis://127.0.0.1:{port}/0",
        block_tokens=4,
        budget_bytes=1 << 20,
        ttl_s=60,
        timeout_s=1.0,
        max_block_bytes=1 << 20,
        max_pending=8,
    )
    try:
        ctx = KVContext("m", "v1", "acme")
        for i in range(30):
            cache.store_async(ctx, [i, 1, 2, 3], [torch.zeros(2, 4)], 0)
            assert len(cache.pending) <= 8
        assert cache.skipped >= 22  # at most 8 waited on the silent Redis; the rest held nothing
    finally:
        cache.close()
        silent.close()
