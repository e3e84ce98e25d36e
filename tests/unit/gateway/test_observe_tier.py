"""The gateway's tier label: a response-cache hit is `cache` (its latency is the cache's), whatever tier's
answer it replays; a worker's answer is labelled by its tier."""

from __future__ import annotations

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.gateway.observe import Observed


def observed(route: pb.RouteInfo) -> Observed:
    call = Observed("Generate")
    call.frame(2, pb.Final(route=route, usage=pb.Usage(prompt_tokens=3, completion_tokens=2)))
    return call


def test_a_cache_hit_is_labelled_cache_and_a_worker_answer_by_its_tier() -> None:
    assert observed(pb.RouteInfo(tier=pb.TIER_CLOUD, cache_hit=True, reason="cache_hit")).tier == "cache"
    assert observed(pb.RouteInfo(tier=pb.TIER_CLOUD, worker_id="cloud-0", reason="hint")).tier == "cloud"
    assert observed(pb.RouteInfo(tier=pb.TIER_EDGE, worker_id="edge-0", reason="prompt_short")).tier == "edge"
