"""Placing a foreground turn: this router's background turns (batch lines, which hold while it runs)
do not count as load on a replica with a free slot, so interactive turns are not crowded together."""

from __future__ import annotations

from dataclasses import replace

from services.common.sampling import SamplingParams
from services.common.tokenizer import Tokenizer
from services.router.balancer.core import Router
from services.router.balancer.registry import Registry, Replica
from services.router.balancer.tiers import TierName
from services.router.types import TurnRequest
from services.store.response_cache import ResponseCache


def _router(tokenizer: Tokenizer, cache: ResponseCache, *replicas: Replica) -> Router:
    registry = Registry([], [], internal_token="t")
    registry.replicas.extend(replicas)
    return Router(
        tokenizer=tokenizer,
        cache=cache,
        registry=registry,
        model_id="m",
        model_version="v1",
        internal_token="t",
        edge_max_prompt_tokens=1000,
        transport=None,  # type: ignore[arg-type]  # select() opens nothing
    )


def _replica(address: str, in_flight: int, background: int) -> Replica:
    return Replica(
        address,
        TierName.EDGE,
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        healthy=True,
        max_active=4,
        in_flight=in_flight,
        background_in_flight=background,
    )


FOREGROUND = TurnRequest([5, 6, 7], SamplingParams(max_tokens=8), TierName.EDGE, False, False, "acme", "req-1")
BACKGROUND = replace(FOREGROUND, background=True)


async def test_a_foreground_turn_goes_to_the_worker_whose_only_turn_is_a_batch_line(
    tokenizer: Tokenizer, cache: ResponseCache
) -> None:
    lines, interactive = _replica("edge-a", 1, 1), _replica("edge-b", 1, 0)
    router = _router(tokenizer, cache, lines, interactive)
    assert all(router.select(FOREGROUND, TierName.EDGE, []) is lines for _ in range(5))
    assert router._placement_load(BACKGROUND, lines) == 1  # a line counts lines as load


async def test_a_worker_whose_slots_are_all_taken_by_lines_is_not_preferred(
    tokenizer: Tokenizer, cache: ResponseCache
) -> None:
    full, interactive = _replica("edge-a", 4, 4), _replica("edge-b", 1, 0)
    router = _router(tokenizer, cache, full, interactive)
    assert all(router.select(FOREGROUND, TierName.EDGE, []) is interactive for _ in range(5))
