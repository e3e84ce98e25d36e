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


def _count(metric: str, tier: str) -> float:
    from prometheus_client import REGISTRY

    value = REGISTRY.get_sample_value(f"{metric}_count", {"service": "gateway", "tier": tier})
    return value or 0.0


def test_a_long_chat_holds_one_turns_latencies_and_a_bounded_prompt_list() -> None:
    from services.gateway.observe import PROMPTS_LOGGED

    call = Observed("Chat", log_prompts=True)
    before_edge = _count("meshserve_time_per_output_token_seconds", "edge")
    before_cloud = _count("meshserve_time_per_output_token_seconds", "cloud")
    for turn in range(200):
        call.prompt(f"turn {turn}", "x" * 10)
        call.turn_started()
        for _ in range(50):
            call.frame(1, None)
        assert len(call.gaps) == 49
        tier = pb.TIER_EDGE if turn % 2 else pb.TIER_CLOUD
        call.frame(0, pb.Final(route=pb.RouteInfo(tier=tier), usage=pb.Usage(prompt_tokens=1, completion_tokens=50)))
        assert call.gaps == [] and call.ttfts == []  # observed at the turn's end, under that turn's tier
    call.record(access_log=False)
    assert len(call.prompts or []) == PROMPTS_LOGGED and call.prompts_omitted == 400 - PROMPTS_LOGGED
    assert _count("meshserve_time_per_output_token_seconds", "edge") - before_edge == 100 * 49
    assert _count("meshserve_time_per_output_token_seconds", "cloud") - before_cloud == 100 * 49
    assert call.first_ttft is not None and call.turns == 200
