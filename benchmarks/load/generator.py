"""Load generation, transport-free: arrival schedules, workload mixes, the two loops, the summary.

* **Open loop** (:func:`open_loop`): requests start at Poisson arrival times at a target rate
  whatever the server does (what users do); latency includes queueing when the server falls behind.
* **Closed loop** (:func:`closed_loop`): a fixed number of workers, each sending its next request
  when the previous one ends (what most load tools do); finds the throughput at that concurrency.

Both are bounded by a request count and a duration. A *sender* is any ``async (WorkItem) -> Result``
(gRPC through the gateway, HTTP through Envoy, a worker called directly: :mod:`benchmarks.load.senders`).
Percentiles come from :func:`benchmarks.stats.percentile`.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.stats import percentile

SHORT_PROMPTS = (
    "Write a short poem about the sea.",
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Give me a tip for learning to cook.",
    "Describe a quiet morning in a village.",
    "Why is the sky blue?",
)
LONG_PARAGRAPH = (
    "The history of the river valley and the towns along it is long and full of change: floods, "
    "markets, bridges, mills and the families that kept them running through good years and bad. "
)
SYSTEM_PROMPTS = (
    "You are a helpful assistant for a travel agency. Answer briefly and politely.",
    "You are a patient tutor who explains science to children in simple words.",
    "You are a concise technical support agent for a home internet provider.",
)
USER_TURNS = ("Hello!", "Can you help me?", "Tell me more.", "Thanks, one last question.", "Summarize that.")


@dataclass(frozen=True)
class Workload:
    """What to send. Fractions of ``short``/``long``/``chat`` are normalized; ``cache_hit_ratio`` of
    the requests repeat one of a few fixed greedy prompts (response cache on), the rest carry a unique
    suffix and bypass the cache."""

    short: float = 1.0
    long: float = 0.0
    chat: float = 0.0
    cache_hit_ratio: float = 0.0
    max_tokens: int = 16
    long_repeats: int = 10
    """Paragraph repeats of a long prompt (10 ≈ 300 tokens: the cloud tier by default)."""
    chat_turns: int = 3
    """Turns of a chat conversation; each turn carries the whole conversation so far."""
    tier: str = "auto"

    def __post_init__(self) -> None:
        if min(self.short, self.long, self.chat) < 0 or self.short + self.long + self.chat <= 0:
            raise ValueError("workload fractions must be >= 0 and not all 0; e.g. --mix short=0.8,long=0.2")
        if not 0.0 <= self.cache_hit_ratio <= 1.0:
            raise ValueError("--cache-hit-ratio must be between 0 and 1")
        if self.max_tokens < 1:
            raise ValueError("--max-tokens must be at least 1")


@dataclass(frozen=True)
class WorkItem:
    """One request: ``messages`` (role, content) pairs; a single user message for a plain prompt."""

    kind: str
    """"short", "long" or "chat"."""
    messages: tuple[tuple[str, str], ...]
    cacheable: bool
    """True: greedy with the response cache on (a repeat of an earlier item is a hit)."""
    max_tokens: int
    tier: str = "auto"

    @property
    def prompt(self) -> str:
        return "\n".join(content for _role, content in self.messages)


@dataclass
class Result:
    """What one request did, client side. Times in seconds from its start."""

    kind: str
    status: str = "OK"
    """"OK" or the error's gRPC status name / "HTTP <code>"."""
    ttft: float | None = None
    token_times: list[float] = field(default_factory=list)
    """Arrival time of every frame that carried tokens."""
    tokens: int = 0
    total: float = 0.0
    route: str = "unknown"
    """"cache", "<tier>/<worker>" or "unknown" (a transport that does not say)."""
    queued: float = 0.0
    """Open loop: how late the request started after its scheduled arrival (client-side backlog)."""


Sender = Callable[[WorkItem], Awaitable[Result]]


def poisson_schedule(rate: float, duration_s: float, max_requests: int, rng: random.Random) -> list[float]:
    """Arrival offsets (s) of a Poisson process at ``rate``/s: exponential gaps, cut at ``duration_s``
    or ``max_requests``, whichever comes first."""
    if rate <= 0:
        raise ValueError("the arrival rate must be > 0 requests/s")
    arrivals: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s and len(arrivals) < max_requests:
        arrivals.append(t)
        t += rng.expovariate(rate)
    return arrivals


def make_items(workload: Workload, n: int, rng: random.Random, tag: str = "") -> list[WorkItem]:
    """``n`` requests drawn from the workload mix with ``rng`` (deterministic for a seed).

    ``tag`` goes into the unique suffix of the non-repeated prompts: give each run its own, or a
    later run would find the earlier run's answers in the response cache.
    """
    weights = [workload.short, workload.long, workload.chat]
    items = []
    for i in range(n):
        kind = rng.choices(("short", "long", "chat"), weights)[0]
        hit = rng.random() < workload.cache_hit_ratio
        # A cacheable item repeats one of a few fixed prompts; the others are made unique.
        salt = "" if hit else f" (request {tag}{i}-{rng.randrange(1 << 30)})"
        if kind == "short":
            messages: tuple[tuple[str, str], ...] = (("user", rng.choice(SHORT_PROMPTS) + salt),)
        elif kind == "long":
            messages = (("user", LONG_PARAGRAPH * workload.long_repeats + "Summarize the above." + salt),)
        else:
            system = rng.choice(SYSTEM_PROMPTS)
            turns = rng.randint(1, workload.chat_turns)
            history: list[tuple[str, str]] = [("system", system)]
            for t in range(turns):
                history.append(("user", USER_TURNS[t % len(USER_TURNS)] + (salt if t == turns - 1 else "")))
                if t < turns - 1:
                    history.append(("assistant", "Of course. Here is a short answer."))
            messages = tuple(history)
        items.append(WorkItem(kind, messages, hit, workload.max_tokens, workload.tier))
    return items


async def _guarded(send: Sender, item: WorkItem, timeout_s: float) -> Result:
    """Every request ends in bounded time: a hung one is recorded as DEADLINE_EXCEEDED (client)."""
    start = time.perf_counter()
    try:
        return await asyncio.wait_for(send(item), timeout_s)
    except TimeoutError:
        return Result(item.kind, status="CLIENT_TIMEOUT", total=time.perf_counter() - start)


async def open_loop(
    send: Sender,
    items: Sequence[WorkItem],
    arrivals: Sequence[float],
    *,
    timeout_s: float = 60.0,
    on_done: Callable[[Result], None] | None = None,
) -> tuple[list[Result], float]:
    """Start ``items[i]`` at ``arrivals[i]`` (s from now); wait for all. Returns results and wall time."""
    t0 = time.perf_counter()

    async def one(item: WorkItem, at: float) -> Result:
        delay = at - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        late = max(0.0, time.perf_counter() - t0 - at)
        result = await _guarded(send, item, timeout_s)
        result.queued = late
        if on_done is not None:
            on_done(result)
        return result

    results = await asyncio.gather(*(one(item, at) for item, at in zip(items, arrivals, strict=False)))
    return list(results), time.perf_counter() - t0


async def closed_loop(
    send: Sender,
    items: Sequence[WorkItem],
    concurrency: int,
    duration_s: float,
    *,
    timeout_s: float = 60.0,
    on_done: Callable[[Result], None] | None = None,
) -> tuple[list[Result], float]:
    """``concurrency`` workers take the next item as soon as their previous request ends, until the
    items run out or ``duration_s`` has passed (requests in flight then finish)."""
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    t0 = time.perf_counter()
    queue = iter(items)
    results: list[Result] = []

    async def worker() -> None:
        while time.perf_counter() - t0 < duration_s:
            item = next(queue, None)
            if item is None:
                return
            result = await _guarded(send, item, timeout_s)
            results.append(result)
            if on_done is not None:
                on_done(result)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - t0


def _pcts(values: list[float], name: str) -> dict[str, float]:
    return {f"{name}_p{q}": round(percentile(values, q), 3) for q in (50, 95, 99)}


def summarize(results: Sequence[Result], wall_s: float) -> dict[str, Any]:
    """TTFT, inter-token and end-to-end latency p50/p95/p99 (ms, successful requests), throughput
    (requests/s and tokens/s over the wall time), errors by status, route and kind mix."""
    ok = [r for r in results if r.status == "OK"]
    ttft = [r.ttft * 1000 for r in ok if r.ttft is not None]
    itl = [(b - a) * 1000 for r in ok for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    e2e = [r.total * 1000 for r in ok]
    tokens = sum(r.tokens for r in ok)
    errors = Counter(r.status for r in results if r.status != "OK")
    routes = Counter(r.route for r in ok)
    return {
        "requests": len(results),
        "ok": len(ok),
        "wall_s": round(wall_s, 3),
        "requests_per_s": round(len(ok) / wall_s, 3) if wall_s > 0 else 0.0,
        "tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else 0.0,
        "tokens": tokens,
        **_pcts(ttft, "ttft_ms"),
        **_pcts(itl, "itl_ms"),
        **_pcts(e2e, "e2e_ms"),
        "client_queue_ms_p99": round(percentile([r.queued * 1000 for r in results], 99), 3) if results else 0.0,
        "errors": dict(sorted(errors.items())),
        "routes": dict(sorted(routes.items())),
        "kinds": dict(sorted(Counter(r.kind for r in results).items())),
        "cache_hit_share": round(routes.get("cache", 0) / len(ok), 3) if ok else 0.0,
    }
