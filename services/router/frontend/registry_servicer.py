"""meshserve.internal.v1.WorkerRegistry as served by the router: heartbeats in, Registry calls."""

from __future__ import annotations

import re

import grpc

from services.common.errors import InvalidArgument
from services.common.pb.meshserve.internal.v1 import registry_pb2, registry_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2
from services.router.balancer.registry import Registry, WorkerReport
from services.router.balancer.tiers import TierName

_TIERS = {inference_pb2.TIER_EDGE: TierName.EDGE, inference_pb2.TIER_CLOUD: TierName.CLOUD}


MAX_ADDRESS_CHARS = 255
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*|\[[0-9A-Fa-f:.]+\]")


def check_address(address: str) -> None:
    """A worker's ``host:port`` (a DNS name, IPv4, or [IPv6]) or INVALID_ARGUMENT quoting at most 64
    characters of it (the router dials what it registers, and logs it)."""
    host, sep, port = address.rpartition(":")
    valid = (
        len(address) <= MAX_ADDRESS_CHARS
        and sep
        and _HOST.fullmatch(host) is not None
        and port.isascii()
        and port.isdigit()
        and 0 < int(port) < 65536
    )
    if not valid:
        shown = address if len(address) <= 64 else f"{address[:64]}..."
        raise InvalidArgument(
            f"worker address {shown!r} must be host:port with a port from 1 to 65535, e.g. 10.0.0.7:7101"
        )


class WorkerRegistryServicer(registry_pb2_grpc.WorkerRegistryServicer):
    """The internal ``WorkerRegistry`` service: workers' heartbeats and leaves, translated to the registry."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    async def Heartbeat(
        self, request: registry_pb2.WorkerHeartbeat, context: grpc.aio.ServicerContext
    ) -> registry_pb2.HeartbeatReply:
        check_address(request.address)
        if request.tier not in _TIERS:
            raise InvalidArgument("heartbeat tier must be TIER_EDGE or TIER_CLOUD")
        report = WorkerReport.from_pb(request.stats) if request.HasField("stats") else None
        ttl = await self._registry.heartbeat(request.address, _TIERS[request.tier], report, leaving=request.leaving)
        return registry_pb2.HeartbeatReply(ttl_ms=int(ttl * 1000))
