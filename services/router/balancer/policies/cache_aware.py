"""The cache-aware replica policy (``routing_policy: cache_aware``, the default).

Replica choice (:class:`CacheAware`), for the healthy replicas of the chosen tier. The load of a
replica is ``load = max(in_flight, active + queued)``: the streams this router has open on it, or
what the replica itself last reported (heartbeat or Stats) when that is higher (other routers).
A replica whose KV budget is (nearly) used up (``Candidate.kv_full``, from its load report) is left
out while another replica has room. Then:

1. **Bounded load** (consistent hashing with bounded loads, Mirrokni et al. 2018): with ``n``
   replicas and total load ``L``, the capacity is ``C = ceil((1 + ε) · (L + 1) / n)``; a replica is
   *eligible* when ``load + 1 <= C``. The least-loaded replica always is, so the set is never empty,
   and no replica is ever pushed above (1 + ε) times the average (rounded up).
2. **Longest cached prefix**: the prompt is cut into blocks of ``block_tokens`` tokens, each named
   by the hash chain of all blocks up to it (:func:`~services.router.balancer.blocks.prefix_blocks`:
   the KV cache's own scheme, ``services.store.keys.kv_block_hashes``, so they equal the hashes workers report).
   A replica
   holds a block when its last load report lists it as hot (``Candidate.hot``: KV the worker really
   holds, including what other routers sent it) or the policy remembers sending it there (LRU,
   ``prefix_capacity`` blocks; the router calls :meth:`CacheAware.forget` when a report in this
   scheme arrives, so the memory only bridges the time until the next report). Among eligible
   replicas the one holding the longest leading run of the prompt's blocks wins (more blocks →
   fewer prefill tokens); ties go to the lower load.
3. **Consistent hashing** for a prefix no replica holds yet: the first block's hash is placed on a
   ring of ``vnodes`` virtual nodes per replica and the ring is walked clockwise to the first
   eligible replica. Requests sharing a system prompt therefore meet on one replica until it is
   full, then overflow to the next one on the ring, and so on: a hot prompt spreads over all
   replicas instead of pinning one, and a replica joining or leaving moves only its own arcs.
4. **Power of two choices** for prompts shorter than one block (nothing worth caching): two
   distinct eligible replicas are drawn at random and the lower ``(load, picks)`` wins (``picks``,
   how often it was chosen, makes ties deterministic and round-robin-like).

In short, the score of an eligible replica ``r`` for a request is the tuple
``(cached_blocks(r), -load(r), -picks(r))``, maximised; ring order breaks a zero-block tie for
multi-block prompts and P2C sampling replaces the full scan for short ones.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import OrderedDict
from collections.abc import Collection, Sequence

from services.common.errors import Unavailable
from services.router.balancer.policies.base import Candidate, PolicyOptions, ReplicaPolicy, Selection


def capacity(total_load: int, n: int, epsilon: float) -> int:
    """Most load one of ``n`` replicas may carry after taking one more request: ceil((1+ε)(L+1)/n)."""
    return max(1, math.ceil((1.0 + epsilon) * (total_load + 1) / n))


class HashRing:
    """Consistent-hash ring with ``vnodes`` virtual nodes per member."""

    def __init__(self, vnodes: int = 64) -> None:
        self._vnodes = vnodes
        self._members: tuple[str, ...] = ()
        self._points: list[tuple[int, str]] = []

    def _build(self, members: Sequence[str]) -> None:
        key = tuple(sorted(members))
        if key == self._members:
            return
        self._members = key
        self._points = sorted(
            (int.from_bytes(hashlib.blake2b(f"{m}#{v}".encode(), digest_size=8).digest(), "big"), m)
            for m in key
            for v in range(self._vnodes)
        )

    def walk(self, key: bytes, members: Sequence[str]) -> list[str]:
        """Members in ring order starting at ``key``'s position, each once."""
        self._build(members)
        if not self._points:
            return []
        h = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")
        lo, hi = 0, len(self._points)
        while lo < hi:  # first point >= h
            mid = (lo + hi) // 2
            if self._points[mid][0] < h:
                lo = mid + 1
            else:
                hi = mid
        seen: dict[str, None] = {}
        n = len(self._points)
        for i in range(n):
            seen.setdefault(self._points[(lo + i) % n][1], None)
            if len(seen) == len(self._members):
                break
        return list(seen)


class CacheAware(ReplicaPolicy):
    """Replica choice by bounded-load consistent hashing + longest cached prefix + P2C (module doc)."""

    def __init__(
        self,
        *,
        epsilon: float = 0.25,
        prefix_capacity: int = 4096,
        vnodes: int = 64,
        rng: random.Random | None = None,
    ) -> None:
        self.epsilon = epsilon
        self._capacity = prefix_capacity
        self._ring = HashRing(vnodes)
        self._rng = rng or random.Random()
        self._held: dict[str, OrderedDict[bytes, None]] = {}
        self.picks: dict[str, int] = {}

    @classmethod
    def from_options(cls, options: PolicyOptions) -> CacheAware:
        return cls(epsilon=options.epsilon)

    def cached_blocks(self, name: str, blocks: Sequence[bytes], hot: Collection[bytes] = ()) -> int:
        """Leading blocks of ``blocks`` that replica ``name`` holds: sent there (remembered) or ``hot``."""
        held = self._held.get(name)
        if not held and not hot:
            return 0
        n = 0
        for b in blocks:
            if not ((held is not None and b in held) or b in hot):
                break
            n += 1
        return n

    def record(self, name: str, blocks: Sequence[bytes]) -> None:
        """Replica ``name`` served (so now holds) ``blocks``; least recently used ones are forgotten."""
        held = self._held.setdefault(name, OrderedDict())
        for b in blocks:
            held[b] = None
            held.move_to_end(b)
        while len(held) > self._capacity:
            held.popitem(last=False)

    def forget(self, name: str) -> None:
        """Replica ``name`` lost its cache (restarted or ejected)."""
        self._held.pop(name, None)

    def drop(self, name: str) -> None:
        """Replica ``name`` left the registry: nothing is kept for it (workers come and go)."""
        self._held.pop(name, None)
        self.picks.pop(name, None)

    def select(self, candidates: Sequence[Candidate], blocks: Sequence[bytes], *, group: str = "") -> Selection:
        if not candidates:
            raise Unavailable("no healthy worker can serve this request right now; retry in a few seconds")
        if len(candidates) == 1:
            return self._chosen(candidates[0], blocks, "only")
        candidates = [c for c in candidates if not c.kv_full] or list(candidates)
        if len(candidates) == 1:
            return self._chosen(candidates[0], blocks, "kv_room")
        cap = capacity(sum(c.load for c in candidates), len(candidates), self.epsilon)
        eligible = [c for c in candidates if c.load + 1 <= cap] or [min(candidates, key=lambda c: c.load)]
        if blocks:
            cached = {c.name: self.cached_blocks(c.name, blocks, c.hot) for c in eligible}
            best = max(eligible, key=lambda c: (cached[c.name], -c.load))
            if cached[best.name] > 0:
                return self._chosen(best, blocks, "prefix")
            by_name = {c.name: c for c in eligible}
            for name in self._ring.walk(blocks[0], [c.name for c in candidates]):
                if name in by_name:
                    return self._chosen(by_name[name], blocks, "ring")
        pair = self._rng.sample(eligible, 2) if len(eligible) > 1 else eligible
        winner = min(pair, key=lambda c: (c.load, self.picks.get(c.name, 0), c.name))
        return self._chosen(winner, blocks, "p2c")

    def _chosen(self, c: Candidate, blocks: Sequence[bytes], reason: str) -> Selection:
        cached = self.cached_blocks(c.name, blocks, c.hot)
        self.picks[c.name] = self.picks.get(c.name, 0) + 1
        self.record(c.name, blocks)
        return Selection(c.name, cached, reason)
