"""gRPC servicer of meshserve.internal.v1.Cache: proto <-> CacheAdmin, nothing else.

Also holds the one transport piece the domain needs: the router call Warm makes.
"""

from __future__ import annotations

import time

import grpc

from services.cache.admin import CacheAdmin, FlushFilter, Generate, WarmLimits
from services.common import errors
from services.common import metadata as md
from services.common.interceptors import outbound_metadata
from services.common.pb.meshserve.internal.v1 import cache_pb2, cache_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2, inference_pb2_grpc
from services.store.keys import Kind

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["Cache"].full_name
_KINDS = {
    cache_pb2.CACHE_KIND_UNSPECIFIED: None,
    cache_pb2.CACHE_KIND_RESPONSE: Kind.RESPONSE,
    cache_pb2.CACHE_KIND_KV: Kind.KV,
}
_KIND_PB = {"response": cache_pb2.CACHE_KIND_RESPONSE, "kv": cache_pb2.CACHE_KIND_KV}


def router_generate(channel: grpc.aio.Channel, internal_token: str) -> Generate:
    """Warm's call: one greedy, shareable request through the router, drained to the end."""
    stub = inference_pb2_grpc.InferenceStub(channel)

    async def generate(prompt: str, max_tokens: int, timeout_s: float) -> None:
        request = inference_pb2.GenerateRequest(
            prompt=prompt,
            sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
            routing=inference_pb2.RoutingOptions(cache_policy=inference_pb2.CACHE_POLICY_SHAREABLE_PREFIX),
        )
        metadata = outbound_metadata(internal_token, **{md.TENANT: "cache-warm"})
        async for _frame in stub.Generate(request, metadata=metadata, timeout=timeout_s):
            pass

    return generate


class CacheServicer(cache_pb2_grpc.CacheServicer):
    """The internal ``Cache`` admin service: translates its RPCs to :class:`CacheAdmin` calls."""

    def __init__(self, admin: CacheAdmin, generate: Generate | None, warm_limits: WarmLimits | None = None) -> None:
        self.admin = admin
        self.generate = generate
        self.warm_limits = warm_limits or WarmLimits()

    async def Stats(
        self, request: cache_pb2.CacheStatsRequest, context: grpc.aio.ServicerContext
    ) -> cache_pb2.CacheStatsResponse:
        stats = await self.admin.stats()
        return cache_pb2.CacheStatsResponse(
            kinds=[
                cache_pb2.CacheKindStats(
                    kind=_KIND_PB[k.kind],
                    hits=k.hits,
                    misses=k.misses,
                    errors=k.errors,
                    corrupt=k.corrupt,
                    skipped=k.skipped,
                    hit_ratio=k.hit_ratio,
                    stored=k.stored,
                    too_large=k.too_large,
                    over_budget=k.over_budget,
                    entries=k.entries,
                    bytes=k.bytes,
                    scopes=k.scopes,
                )
                for k in stats.kinds.values()
            ],
            redis_used_memory_bytes=stats.used_memory,
            redis_maxmemory_bytes=stats.maxmemory,
            redis_maxmemory_policy=stats.maxmemory_policy,
        )

    async def Flush(
        self, request: cache_pb2.FlushRequest, context: grpc.aio.ServicerContext
    ) -> cache_pb2.FlushResponse:
        if request.kind not in _KINDS:
            raise errors.InvalidArgument(f"unknown cache kind {request.kind}")
        what = FlushFilter(
            kind=_KINDS[request.kind],
            model_id=request.model_id or None,
            model_version=request.model_version or None,
            tenant=request.tenant or None,
            shared=request.shared,
            everything=request.all,
        )
        try:
            what.check()
        except ValueError as exc:
            raise errors.InvalidArgument(str(exc)) from None
        return cache_pb2.FlushResponse(keys_deleted=await self.admin.flush(what))

    async def Warm(self, request: cache_pb2.WarmRequest, context: grpc.aio.ServicerContext) -> cache_pb2.WarmResponse:
        if self.generate is None:
            raise errors.Unavailable("warm-up needs the router; set MESHSERVE_CACHE_ROUTER_ADDRESS")
        prompts = [p for p in request.prompts if p.strip()]
        max_tokens = request.max_tokens or 1
        try:
            self.warm_limits.check(prompts, max_tokens)
        except ValueError as exc:
            raise errors.InvalidArgument(str(exc)) from None
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        warmed, failed = await self.admin.warm(prompts, max_tokens, self.generate, self.warm_limits, deadline)
        return cache_pb2.WarmResponse(warmed=warmed, failed=failed)
