"""The request path's data: what a turn asks for, what it streams back, where it ran."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.common import tracing
from services.common.sampling import SamplingParams
from services.router.policy import TierChoice, TierName
from services.router.worker_stream import WorkerStream
from services.store.response_cache import CachedResponse, Finish, ResponseCache


@dataclass(frozen=True)
class Route:
    """Where a turn was served (RouteInfo)."""

    tier: TierName | None
    worker_id: str
    cache_hit: bool
    reason: str


@dataclass(frozen=True)
class Chunk:
    """Tokens (and their text) of a turn, as they reach the caller."""

    token_ids: Sequence[int]
    text: str


@dataclass(frozen=True)
class Done:
    """A turn's end: finish reason, token counts and where it was served."""

    finish_reason: int  # meshserve.v1.FinishReason value
    prompt_tokens: int
    completion_tokens: int
    route: Route


@dataclass
class TurnRequest:
    """One generation to serve: prompt ids already validated against the context length."""

    prompt_ids: list[int]
    sampling: SamplingParams
    hint: TierName | None
    use_cache: bool
    shareable: bool
    tenant: str
    request_id: str
    timeout: float | None = None
    priority: int = 0
    prefix_blocks: list[bytes] | None = None
    """Block hashes of the prompt, computed once by the router."""


@dataclass
class Session:
    """Worker-side state that outlives one turn: the open stream of a chat (None for Generate)."""

    stream: WorkerStream | None = None
    choice: TierChoice | None = None
    chat: bool = False
    """A chat session keeps its worker stream across turns (and is never collapsed)."""

    async def close(self) -> None:
        if self.stream is not None:
            await self.stream.close()
            self.stream = None


@dataclass
class _Progress:
    tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    resumed: int = 0  # tokens sent before the current worker took over
    tiers: set[TierName] = field(default_factory=set)  # tiers whose workers produced tokens
    failovers: int = 0
    first_token_at: float = 0.0


_CACHEABLE_FINISH = {int(f) for f in Finish}
KeyFor = Callable[[TierName], str]
"""The response-cache key of a request answered by a tier's weights."""


async def store_response(
    cache: ResponseCache, key_for: KeyFor | None, req: TurnRequest, progress: _Progress, done: Done
) -> None:
    """Store a finished turn's response under the key of the tier that served it (``key_for`` None: not
    cacheable). A turn resumed on the other tier mid-answer mixes two models' tokens: never stored.
    The router calls it before the final frame goes out, so a repeat sent right after it hits."""
    tier = done.route.tier
    if key_for is None or tier is None or done.finish_reason not in _CACHEABLE_FINISH or progress.tiers - {tier}:
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
