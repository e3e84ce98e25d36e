"""Build the cache admin service's dependencies and start its gRPC server (``__main__`` and tests)."""

from __future__ import annotations

import grpc

from services.cache.admin import CacheAdmin, WarmLimits
from services.cache.config import CacheSettings
from services.cache.servicer import SERVICE_NAME, CacheServicer, router_generate
from services.common.pb.meshserve.internal.v1 import cache_pb2_grpc
from services.common.serving import RunningServer, start_server
from services.store.connection import redis_from_url


async def start_cache_service(settings: CacheSettings) -> RunningServer:
    """Start the admin service; ``await server.stop()`` also closes Redis and the router channel."""
    client = redis_from_url(
        settings.redis_url, settings.timeout_s, max_connections=8, read_timeout_s=settings.timeout_s
    )
    channel = grpc.aio.insecure_channel(settings.router_address) if settings.router_address else None
    generate = router_generate(channel, settings.internal_token) if channel else None
    limits = WarmLimits(settings.warm_timeout_s, settings.warm_max_prompts, settings.warm_max_tokens)
    servicer = CacheServicer(CacheAdmin(client, max_keys=settings.max_keys), generate, limits)
    server = await start_server(
        settings,
        lambda s: cache_pb2_grpc.add_CacheServicer_to_server(servicer, s),
        [SERVICE_NAME],
        internal=True,
    )

    async def close() -> None:
        if channel is not None:
            await channel.close()
        await client.aclose()

    server.on_stop.append(close)
    return server
