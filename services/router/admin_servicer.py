"""meshserve.internal.v1.RouterAdmin as served by the router: its replica view (`meshserve status`) and
where a prompt's KV prefix is (`meshserve cache where`, answered by services/router/location.py)."""

from __future__ import annotations

import time

import grpc

from services.common.errors import InvalidArgument
from services.common.pb.meshserve.internal.v1 import router_admin_pb2, router_admin_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2
from services.router.location import PrefixLocator, RedisAnswer
from services.router.policy import TierName
from services.router.registry import Registry

SERVICE_NAME = router_admin_pb2.DESCRIPTOR.services_by_name["RouterAdmin"].full_name
_TIERS = {TierName.EDGE: inference_pb2.TIER_EDGE, TierName.CLOUD: inference_pb2.TIER_CLOUD}
_ASKED = {
    inference_pb2.TIER_UNSPECIFIED: None,
    inference_pb2.TIER_AUTO: None,
    inference_pb2.TIER_EDGE: TierName.EDGE,
    inference_pb2.TIER_CLOUD: TierName.CLOUD,
}
_REDIS = {
    RedisAnswer.ANSWERED: router_admin_pb2.REDIS_LOOKUP_ANSWERED,
    RedisAnswer.UNAVAILABLE: router_admin_pb2.REDIS_LOOKUP_UNAVAILABLE,
    RedisAnswer.DISABLED: router_admin_pb2.REDIS_LOOKUP_DISABLED,
}


class RouterAdminServicer(router_admin_pb2_grpc.RouterAdminServicer):
    """The internal ``RouterAdmin`` service: lists the registry's replicas, locates prompt prefixes."""

    def __init__(self, registry: Registry, locator: PrefixLocator) -> None:
        self._registry = registry
        self._locator = locator

    def register(self, server: grpc.aio.Server) -> None:
        router_admin_pb2_grpc.add_RouterAdminServicer_to_server(self, server)

    async def ListReplicas(
        self, request: router_admin_pb2.ListReplicasRequest, context: grpc.aio.ServicerContext
    ) -> router_admin_pb2.ListReplicasResponse:
        now = time.monotonic()
        return router_admin_pb2.ListReplicasResponse(
            replicas=[
                router_admin_pb2.ReplicaStatus(
                    address=r.address,
                    worker_id=r.worker_id,
                    tier=_TIERS[r.tier],
                    healthy=r.healthy,
                    active_sequences=r.active_sequences,
                    queue_depth=r.queue_depth,
                    max_active_sequences=r.max_active,
                    in_flight=max(0, r.in_flight),
                    load=max(0, r.load),
                    ejections=r.ejections,
                    self_registered=r.registered_until > 0,
                    recent_tokens_per_second=r.report.tokens_per_s,
                    kv_tokens=r.report.kv_tokens,
                    kv_used_bytes=r.report.kv_used_bytes,
                    kv_budget_bytes=r.report.kv_budget_bytes,
                    held_sequences=r.report.held_sequences,
                    hot_prefix_blocks=len(r.hot_blocks),
                    kv_full=r.kv_full,
                    report_age_ms=int((now - r.reported_at) * 1000) if r.reported_at else 0,
                )
                for r in self._registry.replicas
            ]
        )

    async def PrefixLocation(
        self, request: router_admin_pb2.PrefixLocationRequest, context: grpc.aio.ServicerContext
    ) -> router_admin_pb2.PrefixLocationResponse:
        if request.tier not in _ASKED:
            raise InvalidArgument(f"unknown tier {request.tier}; use TIER_AUTO, TIER_EDGE or TIER_CLOUD")
        where = await self._locator.locate(
            text=request.text,
            messages=[{"role": m.role, "content": m.content} for m in request.messages],
            tenant=request.tenant,
            shareable=request.shareable_prefix,
            tier=_ASKED[request.tier],
        )
        return router_admin_pb2.PrefixLocationResponse(
            prompt_tokens=where.prompt_tokens,
            block_tokens=where.block_tokens,
            prompt_blocks=where.prompt_blocks,
            tier=_TIERS[where.tier.tier],
            tier_reason=where.tier.reason,
            replicas=[
                router_admin_pb2.PrefixHolder(address=h.address, worker_id=h.worker_id, cached_blocks=h.cached_blocks)
                for h in where.holders
            ],
            redis=_REDIS[where.redis],
            redis_blocks=where.redis_blocks,
            redis_checked_blocks=where.redis_checked_blocks,
            redis_block_tokens=where.redis_block_tokens,
            model_id=where.model_id,
            model_version=where.model_version,
        )
