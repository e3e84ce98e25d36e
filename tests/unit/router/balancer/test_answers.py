"""An answer's names include the tier whose weights produce it; a finished turn is stored under the tier
that served it (fakes for the cache: the real router + Redis are in tests/integration/router/test_cache_tiers.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.sampling import SamplingParams
from services.router.balancer.answers import AnswerKeys, Progress, store_response
from services.router.balancer.tiers import TierName
from services.router.types import Done, Route, TurnRequest
from services.store.keys import scope_of
from services.store.response_cache import CachedResponse, Finish

EDGE, CLOUD = TierName.EDGE, TierName.CLOUD


@dataclass
class FakeCache:
    enabled: bool = True
    puts: list[tuple[str, CachedResponse]] = field(default_factory=list)

    async def put(self, key: str, response: CachedResponse) -> None:
        self.puts.append((key, response))


def keys(cache: FakeCache | None = None, collapse: bool = True) -> AnswerKeys:
    return AnswerKeys("m", "v1", "tok", cache or FakeCache(), collapse)  # type: ignore[arg-type]


def turn(**over: Any) -> TurnRequest:
    args: dict[str, Any] = dict(
        prompt_ids=[5, 6, 7],
        sampling=SamplingParams(max_tokens=4),
        hint=None,
        use_cache=True,
        shareable=False,
        tenant="acme",
        request_id="r",
    )
    args.update(over)
    return TurnRequest(**args)


def test_each_tier_names_its_own_answer() -> None:
    k = keys()
    assert k.key(turn(), EDGE) != k.key(turn(), CLOUD)
    assert k.key(turn(), EDGE) == k.key(turn(hint=EDGE), EDGE) == keys().key(turn(), EDGE)
    assert scope_of(k.key(turn(), EDGE)) == scope_of(k.key(turn(), CLOUD))  # one tenant scope: flush, budget
    assert k.cache_key(turn(), CLOUD) == k.key(turn(), CLOUD)
    assert k.collapse_key(turn(), EDGE, chat=False) != k.collapse_key(turn(), CLOUD, chat=False)
    assert k.collapse_key(turn(hint=CLOUD), CLOUD, chat=False) != k.collapse_key(turn(), CLOUD, chat=False)


def test_tools_and_tool_choice_are_part_of_an_answers_name() -> None:
    k = keys()
    assert k.key(turn(tools_key=""), EDGE) == k.key(turn(), EDGE)  # no tools: the keys they always were
    named = {k.key(turn(tools_key=x), EDGE) for x in ("", "a", "b")}
    assert len(named) == 3
    assert k.collapse_key(turn(tools_key="a"), EDGE, chat=False) != k.collapse_key(turn(), EDGE, chat=False)


def test_only_deterministic_requests_that_allow_it_have_names() -> None:
    k = keys()
    assert k.cache_key(turn(use_cache=False), EDGE) is None
    assert k.cache_key(turn(sampling=SamplingParams(max_tokens=4, temperature=0.7)), EDGE) is None
    assert k.cache_key(turn(sampling=SamplingParams(max_tokens=4, temperature=0.7, seed=1)), EDGE) is not None
    assert keys(FakeCache(enabled=False)).cache_key(turn(), EDGE) is None
    assert k.collapse_key(turn(), EDGE, chat=True) is None
    assert keys(collapse=False).collapse_key(turn(), EDGE, chat=False) is None


def done(tier: TierName | None, finish: int = pb.FINISH_REASON_LENGTH) -> Done:
    return Done(finish, 3, 2, Route(tier, "w", False, "hint"))


def progress(*tiers: TierName) -> Progress:
    return Progress(tokens=[11, 12], text=["a", "b"], tiers=set(tiers))


async def test_a_finished_turn_is_stored_under_the_tier_that_served_it() -> None:
    cache, k, req = FakeCache(), keys(), turn(hint=CLOUD)
    await store_response(cache, lambda t: k.key(req, t), req, progress(EDGE), done(EDGE))  # type: ignore[arg-type]
    ((key, response),) = cache.puts
    assert key == k.key(req, EDGE)  # a cloud hint that fell back to the edge: the edge's answer
    assert response == CachedResponse((11, 12), "ab", Finish.LENGTH, 3, 2)


async def test_what_is_never_stored() -> None:
    cache, k, req = FakeCache(), keys(), turn()

    def key_for(t: TierName) -> str:
        return k.key(req, t)

    await store_response(cache, None, req, progress(EDGE), done(EDGE))  # type: ignore[arg-type]
    await store_response(cache, key_for, req, progress(EDGE, CLOUD), done(CLOUD))  # type: ignore[arg-type]
    await store_response(cache, key_for, req, progress(EDGE), done(EDGE, pb.FINISH_REASON_CANCELLED))  # type: ignore[arg-type]
    await store_response(cache, key_for, req, progress(), done(None))  # type: ignore[arg-type]
    assert cache.puts == []
    await store_response(cache, key_for, req, progress(), done(CLOUD, pb.FINISH_REASON_STOP))  # type: ignore[arg-type]
    assert [key for key, _ in cache.puts] == [k.key(req, CLOUD)]  # an empty answer is still the cloud's


async def test_a_budget_closed_answer_is_not_stored() -> None:
    """The cache entry has no room for the flag: a hit would serve the answer without it."""
    from dataclasses import replace

    cache, k, req = FakeCache(), keys(), turn()
    closed = replace(done(EDGE, pb.FINISH_REASON_STOP), budget_closed=True)
    await store_response(cache, lambda t: k.key(req, t), req, progress(EDGE), closed)  # type: ignore[arg-type]
    assert cache.puts == []
