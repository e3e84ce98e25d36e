"""Priority classes and token-weighted fair queuing across tenants. Pure: no grpc, no asyncio.

Used when the chosen tier is saturated: requests wait in the router instead of piling up in the
workers' FIFO queues, and are released one per freed slot in this order:

1. higher ``priority`` first (RoutingOptions.priority, 0-9);
2. within a priority class, start-time fair queuing (Goyal et al. 1996) weighted by tokens: a
   request of ``cost`` tokens (prompt + max_tokens) from tenant ``t`` gets the start tag
   ``S = max(V, F_t)`` and advances ``F_t = S + cost / weight_t``, where ``V`` is the start tag of
   the request released last. The smallest ``S`` is released next (ties: arrival order).

A tenant that sends many or large requests therefore advances its own tags quickly and cannot
starve a light tenant, whose next request is tagged near ``V`` and released within about one
request of each other active tenant, whatever the heavy tenant has queued.

Bounded memory, whatever the number of tenants that come and go: a tenant's finish tag is forgotten
once it is at or below ``V`` (its next request would be tagged ``V`` either way, so this changes no
order), and beyond ``max_tenants`` remembered tags the smallest are forgotten (the tenants closest to
``V``: the least advantage lost). Withdrawn entries leave the heap when it holds twice as many dead
entries as live ones, so waiters that give up under a queue that is never drained do not pile up.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(order=True)
class _Entry(Generic[T]):
    key: tuple[int, float, int]
    item: T = field(compare=False)
    tenant: str = field(compare=False)
    priority: int = field(compare=False)
    removed: bool = field(default=False, compare=False)  # released or withdrawn


class FairQueue(Generic[T]):
    """Waiting requests ordered by priority class, then token-weighted fair share per tenant."""

    def __init__(self, weights: Mapping[str, float] | None = None, *, max_tenants: int = 10_000) -> None:
        self._weights = dict(weights or {})
        self._max_tenants = max_tenants
        self._heap: list[_Entry[T]] = []
        self._finish: dict[str, float] = {}
        self._vtime = 0.0
        self._seq = itertools.count()
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def push(self, item: T, *, tenant: str, cost: int, priority: int = 0) -> _Entry[T]:
        """Queue ``item``; the returned handle can be passed to :meth:`remove`."""
        start = max(self._vtime, self._finish.get(tenant, 0.0))
        self._finish[tenant] = start + max(1, cost) / self._weights.get(tenant, 1.0)
        entry = _Entry((-priority, start, next(self._seq)), item, tenant, priority)
        heapq.heappush(self._heap, entry)
        self._live += 1
        if len(self._finish) > self._max_tenants:
            self._forget_tenants()
        return entry

    def _forget_tenants(self) -> None:
        """Drop tags at or below ``V`` (no effect on order), then the smallest beyond the cap."""
        self._finish = {t: f for t, f in self._finish.items() if f > self._vtime}
        if len(self._finish) > self._max_tenants // 2:
            keep = sorted(self._finish.items(), key=lambda tf: tf[1])[-(self._max_tenants // 2) :]
            self._finish = dict(keep)

    def _compact(self) -> None:
        """Rebuild the heap without withdrawn entries (amortized: runs once dead ones outnumber live 2:1)."""
        if len(self._heap) > 2 * self._live + 64:
            self._heap = [e for e in self._heap if not e.removed]
            heapq.heapify(self._heap)

    def pop(self) -> T | None:
        """The next item to release, or None when empty."""
        while self._heap:
            entry = heapq.heappop(self._heap)
            if entry.removed:
                continue
            entry.removed = True
            self._live -= 1
            self._vtime = max(self._vtime, entry.key[1])
            return entry.item
        return None

    def remove(self, entry: _Entry[T]) -> None:
        """Drop a waiting item (its caller gave up); a no-op if it was already released."""
        if not entry.removed:
            entry.removed = True
            self._live -= 1
            self._compact()

    def ahead_of(self, priority: int) -> int:
        """Waiting items that would be released before a new item of ``priority`` (upper bound)."""
        return sum(1 for e in self._heap if not e.removed and e.priority >= priority)
