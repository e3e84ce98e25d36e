"""A request's answer: its names (response-cache entry, collapse key), how a finished one is stored and
how a cached one is served.

The tiers run different weights under one model id (edge: the INT4 student, cloud: the fp32
teacher), so one deterministic request has one answer *per tier*: every name here includes the
tier whose weights produce the answer. The router decides that tier before the cache lookup
(``Router.answer_tier``) and stores a finished answer under the tier that actually served it
(:func:`store_response`). Keys themselves come from ``services.store.keys``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from services.common import tracing
from services.router.balancer.tiers import TierName
from services.router.types import Chunk, Done, Route, TurnRequest
from services.store.keys import response_key
from services.store.response_cache import CachedResponse, Finish, ResponseCache


@dataclass(frozen=True)
class AnswerKeys:
    """Key builders of one router (its model, version and tokenizer)."""

    model_id: str
    model_version: str
    tokenizer_id: str
    cache: ResponseCache
    collapse: bool = True
    """Whether identical deterministic requests in flight may share one computation."""

    def key(self, req: TurnRequest, tier: TierName) -> str:
        """The response-cache key of ``req`` as ``tier``'s weights answer it."""
        return response_key(
            model_id=self.model_id,
            model_version=self.model_version,
            tier=tier.value,
            tokenizer_id=self.tokenizer_id,
            sampling=req.sampling,
            prompt_ids=req.prompt_ids,
            tenant=req.tenant,
            shareable=req.shareable,
            tools=req.tools_key,
        )

    def cache_key(self, req: TurnRequest, tier: TierName) -> str | None:
        """:meth:`key`, or None when ``req`` must not use the cache (bypass, sampled, n > 1, cache off,
        logprobs: entries hold no logprobs, so such a request is neither answered from nor stored in the cache)."""
        sampling = req.sampling
        if not (req.use_cache and self.cache.enabled and sampling.deterministic) or sampling.n > 1 or sampling.logprobs:
            return None
        return self.key(req, tier)

    def collapse_key(self, req: TurnRequest, tier: TierName, *, chat: bool) -> str | None:
        """Identical deterministic requests that may share the caches, bound for the same tier with the
        same hint, may share one computation (chat turns and n > 1 requests never do)."""
        if not (self.collapse and req.use_cache and req.sampling.deterministic) or chat or req.sampling.n > 1:
            return None
        hint = req.hint.value if req.hint else "auto"
        return f"{self.key(req, tier)}:{hint}"


@dataclass
class Progress:
    """The answer so far of a turn being relayed: what was sent to the caller, across failovers."""

    tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    resumed: int = 0
    """Tokens sent before the current worker took over."""
    tiers: set[TierName] = field(default_factory=set)
    """Tiers whose workers produced tokens."""
    failovers: int = 0
    crossed: bool = False
    """A resume continued on a worker of another build (its tokens may differ from an undisturbed run)."""
    choices: int = 1
    """The turn's ``SamplingParams.n``; with more than one, ``tokens`` and ``text`` hold every choice's."""
    finals: int = 0
    """Choices that ended (their Done relayed)."""


_CACHEABLE_FINISH = {int(f) for f in Finish}
KeyFor = Callable[[TierName], str]
"""The response-cache key of a request answered by a tier's weights."""


async def store_response(
    cache: ResponseCache, key_for: KeyFor | None, req: TurnRequest, progress: Progress, done: Done
) -> None:
    """Store a finished turn's response under the key of the tier that served it (``key_for`` None: not
    cacheable). A turn resumed on the other tier mid-answer mixes two models' tokens: never stored.
    The router calls it before the final event goes out, so a repeat sent right after it hits."""
    tier = done.route.tier
    if key_for is None or tier is None or done.finish_reason not in _CACHEABLE_FINISH or progress.tiers - {tier}:
        return
    if progress.crossed:  # part of it came from another build: not the answer of either
        return
    if done.budget_closed:  # the entry has no room for the flag: a hit would lose it (structured_output.md)
        return
    key = key_for(tier)
    response = CachedResponse(
        tuple(progress.tokens),
        "".join(progress.text),
        Finish(done.finish_reason),
        len(req.prompt_ids),
        done.completion_tokens,
    )
    await cache.put(key, response)


async def cached_turn(cache: ResponseCache, key: str, tier: TierName, req: TurnRequest) -> tuple[Chunk, Done] | None:
    """The answer cached under ``key`` (``tier``'s weights produced it) as a turn's events; None on a miss."""
    with tracing.span("router.cache_lookup") as lookup:
        hit = await cache.get(key)
        lookup.set_attribute("meshserve.cache.hit", hit is not None)
    if hit is None:
        return None
    route = Route(tier, "", True, "cache_hit")
    return Chunk(hit.token_ids, hit.text), Done(int(hit.finish), len(req.prompt_ids), hit.completion_tokens, route)
