"""meshserve.internal.v1.WorkerRegistry as served by the router: heartbeats in, Registry calls."""

from __future__ import annotations

import grpc

from services.common.errors import InvalidArgument
from services.common.pb.meshserve.internal.v1 import registry_pb2, registry_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2
from services.router.policy import TierName
from services.router.registry import Registry, WorkerReport

_TIERS = {inference_pb2.TIER_EDGE: TierName.EDGE, inference_pb2.TIER_CLOUD: TierName.CLOUD}


class WorkerRegistryServicer(registry_pb2_grpc.WorkerRegistryServicer):
    """The internal ``WorkerRegistry`` service: workers' heartbeats and leaves, translated to the registry."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    async def Heartbeat(
        self, request: registry_pb2.WorkerHeartbeat, context: grpc.aio.ServicerContext
    ) -> registry_pb2.HeartbeatReply:
        host, sep, port = request.address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise InvalidArgument(f"worker address {request.address!r} must be host:port, e.g. 10.0.0.7:7101")
        if request.tier not in _TIERS:
            raise InvalidArgument("heartbeat tier must be TIER_EDGE or TIER_CLOUD")
        report = WorkerReport.from_pb(request.stats) if request.HasField("stats") else None
        ttl = await self._registry.heartbeat(request.address, _TIERS[request.tier], report, leaving=request.leaving)
        return registry_pb2.HeartbeatReply(ttl_ms=int(ttl * 1000))
