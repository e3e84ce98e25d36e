"""meshserve.internal.v1.RouterAdmin as served by the router: its replica view, for `meshserve status`."""

from __future__ import annotations

import time

import grpc

from services.common.pb.meshserve.internal.v1 import router_admin_pb2, router_admin_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2
from services.router.policy import TierName
from services.router.registry import Registry

SERVICE_NAME = router_admin_pb2.DESCRIPTOR.services_by_name["RouterAdmin"].full_name
_TIERS = {TierName.EDGE: inference_pb2.TIER_EDGE, TierName.CLOUD: inference_pb2.TIER_CLOUD}


class RouterAdminServicer(router_admin_pb2_grpc.RouterAdminServicer):
    """The internal ``RouterAdmin`` service (``meshserve status``): lists the registry's replicas."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

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
