"""PrefixLocator over a real Router and tokenizer with fake replicas (no workers, no network)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from services.common.errors import InvalidArgument
from services.common.tokenizer import Tokenizer
from services.router.balancer.blocks import prefix_blocks
from services.router.balancer.core import Router
from services.router.balancer.registry import Registry, Replica, WorkerReport
from services.router.balancer.stream_transport import StreamTransport
from services.router.balancer.tiers import TierName
from services.router.frontend.location import MAX_PROMPT_CHARS, PrefixLocator, RedisAnswer
from services.store.response_cache import ResponseCache
from tests.helpers import free_port

BT = 4
LONG = "The quick brown fox jumps over the lazy dog near the river bank. " * 4


def _replica(address: str, tier: TierName, healthy: bool = True, **kw: Any) -> Replica:
    return Replica(address, tier, None, None, healthy=healthy, **kw)  # type: ignore[arg-type]


def _router(tokenizer: Tokenizer, cache: ResponseCache, replicas: list[Replica]) -> Router:
    registry = Registry([], [], internal_token="t", block_tokens=BT, model_version="v1")
    registry.replicas.extend(replicas)
    return Router(
        tokenizer=tokenizer,
        cache=cache,
        registry=registry,
        model_id="m",
        model_version="v1",
        internal_token="t",
        edge_max_prompt_tokens=16,
        block_tokens=BT,
        transport=StreamTransport("t"),
    )


@pytest.fixture
async def no_redis() -> AsyncIterator[ResponseCache]:
    cache = ResponseCache.from_url("")
    yield cache
    await cache.close()


def _hashes(tokenizer: Tokenizer, text: str, tenant: str = "", shareable: bool = False) -> list[bytes]:
    ids = tokenizer.encode(text)
    return prefix_blocks(ids, BT, model_id="m", model_version="v1", tenant=tenant, shareable=shareable)


async def test_replica_counts_are_the_routing_counts(tokenizer: Tokenizer, no_redis: ResponseCache) -> None:
    blocks = _hashes(tokenizer, LONG, tenant="acme")
    assert len(blocks) >= 6
    two = _replica("a:1", TierName.CLOUD, worker_id="cloud-a", hot_blocks=frozenset(blocks[:2]))
    gap = _replica("b:1", TierName.CLOUD, worker_id="cloud-b", hot_blocks=frozenset([blocks[0], blocks[2]]))
    other_tenant = _hashes(tokenizer, LONG, tenant="other")
    foreign = _replica("c:1", TierName.CLOUD, hot_blocks=frozenset(other_tenant))
    down = _replica("d:1", TierName.CLOUD, healthy=False, hot_blocks=frozenset(blocks))
    edge = _replica("e:1", TierName.EDGE, hot_blocks=frozenset(blocks))
    router = _router(tokenizer, no_redis, [two, gap, foreign, down, edge])
    router.selector.record("c:1", blocks[:3])  # what the router sent there since its last report
    locator = PrefixLocator(router, block_tokens=BT, context_length=8192)

    where = await locator.locate(text=LONG, tenant="acme", tier=TierName.CLOUD)
    assert where.prompt_tokens == len(tokenizer.encode(LONG)) and where.prompt_blocks == len(blocks)
    assert (where.tier.tier, where.tier.reason) == (TierName.CLOUD, "requested")
    assert [(h.address, h.worker_id, h.cached_blocks) for h in where.holders] == [
        ("a:1", "cloud-a", 2),
        ("b:1", "cloud-b", 1),  # a gap after block 0: the run is 1
        ("c:1", "", 3),  # another tenant's blocks never count; the router's memory does
    ]
    assert where.redis is RedisAnswer.DISABLED and where.redis_blocks == 0
    shared = await locator.locate(text=LONG, tenant="acme", shareable=True, tier=TierName.CLOUD)
    assert [h.cached_blocks for h in shared.holders] == [0, 0, 0]  # the shared scope is another chain


async def test_tier_is_the_routing_choice_unless_asked(tokenizer: Tokenizer, no_redis: ResponseCache) -> None:
    router = _router(tokenizer, no_redis, [_replica("e:1", TierName.EDGE), _replica("c:1", TierName.CLOUD)])
    locator = PrefixLocator(router, block_tokens=BT, context_length=8192)
    short = await locator.locate(text="Hi")
    assert (short.tier.tier, short.tier.reason) == (TierName.EDGE, "prompt_short")
    assert [h.address for h in short.holders] == ["e:1"]
    long = await locator.locate(text=LONG)
    assert (long.tier.tier, long.tier.reason) == (TierName.CLOUD, "prompt_long")
    assert [h.address for h in long.holders] == ["c:1"]
    router.registry.replicas[1].healthy = False
    spill = await locator.locate(text=LONG)
    assert (spill.tier.tier, spill.tier.reason) == (TierName.EDGE, "spill")
    asked = await locator.locate(text=LONG, tier=TierName.CLOUD)  # a query: no replica is no error
    assert asked.tier.tier is TierName.CLOUD and asked.holders == []
    router.registry.replicas[0].healthy = False
    none = await locator.locate(text=LONG)
    assert (none.tier.tier, none.tier.reason, none.holders) == (TierName.CLOUD, "no_healthy_worker", [])


async def test_chat_messages_are_tokenized_as_a_chat_turn(tokenizer: Tokenizer, no_redis: ResponseCache) -> None:
    locator = PrefixLocator(_router(tokenizer, no_redis, []), block_tokens=BT, context_length=8192)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    where = await locator.locate(messages=messages)
    assert where.prompt_tokens == len(tokenizer.apply_chat_template(messages))


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({}, "the prompt is empty"),
        ({"text": "a", "messages": [{"role": "user", "content": "b"}]}, "not both"),
        ({"text": "x" * (MAX_PROMPT_CHARS + 1)}, "characters long"),
        ({"text": LONG * 4}, "more than the model's context of 64 tokens"),
        ({"messages": [{"role": "wizard", "content": "b"}]}, "role must be one of"),
    ],
)
async def test_bad_prompts_are_invalid_arguments(
    tokenizer: Tokenizer, no_redis: ResponseCache, kw: dict[str, Any], says: str
) -> None:
    locator = PrefixLocator(_router(tokenizer, no_redis, []), block_tokens=BT, context_length=64)
    with pytest.raises(InvalidArgument, match=says):
        await locator.locate(**kw)


async def test_redis_scope_comes_from_cloud_reports_and_a_dead_redis_is_unknown(tokenizer: Tokenizer) -> None:
    cache = ResponseCache.from_url(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)  # nothing listens there
    report = WorkerReport(worker_id="w", model_id="wm", model_version="wv", block_tokens=8)
    cloud = _replica("c:1", TierName.CLOUD, report=report)
    edge = _replica("e:1", TierName.EDGE, report=WorkerReport(model_version="ev", block_tokens=2))
    locator = PrefixLocator(
        _router(tokenizer, cache, [edge, cloud]), block_tokens=BT, context_length=8192, max_blocks=3
    )
    try:
        where = await locator.locate(text=LONG, tier=TierName.EDGE)
        assert (where.model_id, where.model_version, where.redis_block_tokens) == ("wm", "wv", 8)
        assert where.redis is RedisAnswer.UNAVAILABLE and where.redis_blocks == 0
        assert where.redis_checked_blocks == 3  # capped
        no_report = PrefixLocator(_router(tokenizer, cache, [edge]), block_tokens=BT, context_length=8192)
        where = await no_report.locate(text=LONG)
        assert (where.model_id, where.model_version, where.redis_block_tokens) == ("m", "v1", BT)
    finally:
        await cache.close()
