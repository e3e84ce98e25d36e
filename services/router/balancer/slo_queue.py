"""SLO-aware admission, priorities and fair queuing in front of each tier. No grpc.

Each tier has ``slots`` (the sum of its healthy replicas' concurrent sequences). A turn takes one
slot while it runs. When none is free it waits in the tier's :class:`FairQueue` (priority classes,
then token-weighted fair share across tenants) instead of piling up in the workers' FIFO queues.

Before waiting, the time to first token is estimated (:meth:`Admission.estimate_ttft_s`)::

    wait    = 0                                   if a slot is free and nobody waits
            = (ahead + 1) * turn_s / slots        otherwise (ahead: waiters released first)
    prefill = uncached_prompt_tokens * prefill_s_per_token
    ttft    = wait + prefill

``turn_s`` (how long a turn holds its slot) and ``prefill_s_per_token`` are exponentially weighted
averages of what this router observed, seeded from settings. When the estimate exceeds the tenant's
TTFT SLO the request is shed at once with ResourceExhausted and ``retry-after-ms`` = the excess,
rather than queueing for an answer that would come too late.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from services.common.errors import ResourceExhausted
from services.router.balancer.fairness import FairQueue
from services.router.balancer.tiers import TierName
from services.router.metrics import QUEUE_TIME, SHED

_EWMA = 0.2


@dataclass(eq=False)
class Ticket:
    """One held slot of a tier; give it back with :meth:`Admission.release`."""

    tier: TierName
    waited_s: float
    released: bool = False


@dataclass
class _Tier:
    busy: int = 0
    queue: FairQueue[asyncio.Future[None]] = field(default_factory=FairQueue)


class Admission:
    """Slots per tier, the wait queues, the TTFT estimate and the shedding decision."""

    def __init__(
        self,
        slots: Callable[[TierName], int],
        *,
        default_slo_ms: int = 0,
        tenant_slo_ms: Mapping[str, int] | None = None,
        tenant_weights: Mapping[str, float] | None = None,
        turn_s: float = 2.0,
        prefill_s_per_token: float = 0.0005,
    ) -> None:
        self._slots = slots
        self._default_slo_ms = default_slo_ms
        self._tenant_slo_ms = dict(tenant_slo_ms or {})
        self._weights = dict(tenant_weights or {})
        self.turn_s = turn_s
        self.prefill_s_per_token = prefill_s_per_token
        self._tiers: dict[TierName, _Tier] = {}

    def _tier(self, tier: TierName) -> _Tier:
        if tier not in self._tiers:
            self._tiers[tier] = _Tier(queue=FairQueue(self._weights))
        return self._tiers[tier]

    def saturated(self, tier: TierName) -> bool:
        """No free slot (someone would have to wait)."""
        t = self._tier(tier)
        return t.busy >= self._slots(tier) or len(t.queue) > 0

    def waiting(self, tier: TierName) -> int:
        """Requests queued for a slot of ``tier``."""
        return len(self._tier(tier).queue)

    def busy(self, tier: TierName) -> int:
        """Slots of ``tier`` held by turns in flight."""
        return self._tier(tier).busy

    def slo_ms(self, tenant: str) -> int:
        """The tenant's TTFT SLO in ms (0 = none: never shed)."""
        return self._tenant_slo_ms.get(tenant, self._default_slo_ms)

    def estimate_ttft_s(self, tier: TierName, priority: int, uncached_tokens: int) -> float:
        t = self._tier(tier)
        slots = max(1, self._slots(tier))
        wait = 0.0
        if t.busy >= slots or len(t.queue):
            wait = (t.queue.ahead_of(priority) + 1) * self.turn_s / slots
        return wait + uncached_tokens * self.prefill_s_per_token

    async def acquire(self, tier: TierName, *, tenant: str, priority: int, cost: int, uncached_tokens: int) -> Ticket:
        """A slot of ``tier``, waiting fairly for one; sheds (ResourceExhausted) when the SLO can't be met."""
        slo = self.slo_ms(tenant)
        estimate = self.estimate_ttft_s(tier, priority, uncached_tokens)
        if slo > 0 and estimate * 1000 > slo:
            SHED.labels(tier.value, str(priority)).inc()
            retry_ms = max(100, math.ceil(estimate * 1000 - slo))
            raise ResourceExhausted(
                f"estimated time to first token {estimate * 1000:.0f} ms exceeds the {slo} ms objective; "
                f"retry in {retry_ms} ms",
                retry_ms,
            )
        t = self._tier(tier)
        started = time.perf_counter()
        if t.busy < self._slots(tier) and not len(t.queue):
            t.busy += 1
        else:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            entry = t.queue.push(waiter, tenant=tenant, cost=cost, priority=priority)
            try:
                while not waiter.done():
                    # Re-check now and then: slots also grow when a replica comes back.
                    await asyncio.wait({waiter}, timeout=1.0)
                    self.pump(tier)
                waiter.result()
            except BaseException:
                t.queue.remove(entry)
                if waiter.done() and not waiter.cancelled():
                    self._release_slot(tier)  # granted just as we gave up: pass it on
                raise
        waited = time.perf_counter() - started
        QUEUE_TIME.labels(tier.value).observe(waited)
        return Ticket(tier, waited)

    def release(self, ticket: Ticket, held_s: float | None = None) -> None:
        """Give the slot back; ``held_s`` (a completed turn's duration) feeds the turn-time average."""
        if ticket.released:
            return
        ticket.released = True
        if held_s is not None:
            self.turn_s += _EWMA * (held_s - self.turn_s)
        self._release_slot(ticket.tier)

    def observe_prefill(self, ttft_s: float, prefill_tokens: int) -> None:
        """A turn that did not wait got its first token after ``ttft_s`` for ``prefill_tokens``."""
        if prefill_tokens > 0:
            self.prefill_s_per_token += _EWMA * (ttft_s / prefill_tokens - self.prefill_s_per_token)

    def _release_slot(self, tier: TierName) -> None:
        t = self._tier(tier)
        t.busy -= 1
        self.pump(tier)

    def pump(self, tier: TierName) -> None:
        """Hand free slots to waiters (also call when a tier's slot count grows)."""
        t = self._tier(tier)
        while t.busy < self._slots(tier):
            waiter = t.queue.pop()
            if waiter is None:
                return
            if waiter.done():
                continue
            t.busy += 1
            waiter.set_result(None)
