"""Admission of one request: identity → tenant policy → policy checks → rate-limit reservation.

The servicer calls :meth:`Gate.identify` once per call and :meth:`Gate.admit` once per request (a
Generate/Complete call, or one Chat turn), and :meth:`Gate.settle_soon` when that request ends —
finished, failed or cancelled — with the tokens it really used. Settling runs as its own task so a
cancelled call still gives its unused tokens back.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import structlog
from prometheus_client import Counter

from services.common import tracing
from services.common.errors import InvalidArgument, ResourceExhausted
from services.gateway.identity import Authenticator, Identity
from services.gateway.policy import (
    PolicyBook,
    TenantPolicy,
    check_request,
    estimate_prompt_tokens,
)
from services.gateway.ratelimit import RateLimiter, Reservation

log = structlog.get_logger(__name__)
_REFUSED_TENANTS = 10_000  # tenants remembered as recently refused (least recent forgotten first)

ADMITTED = Counter(
    "meshserve_gateway_admitted_total",
    "Requests the gateway admitted, by tenant and credential source (static, keystore, jwt).",
    ["service", "tenant", "source"],
)
SPECULATIVE_STARTS = Counter(
    "meshserve_gateway_speculative_starts_total",
    "Requests started on a worker before their rate-limit reservation was known, by how it ended.",
    ["service", "outcome"],
)


@dataclass
class Ticket:
    """One admitted request: its policy, its token estimate and what the limiter reserved."""

    policy: TenantPolicy
    prompt_tokens: int
    reservation: Reservation | None = None
    completion_seen: int = 0
    used: int | None = None
    """Real usage from the final frame (prompt + completion), once seen."""
    settling: bool = False
    """Set by :meth:`Gate.settle_soon`: a ticket is settled once, however many paths try."""

    def tokens_used(self) -> int:
        """Usage to settle with: the final frame's if it came, else estimate + tokens streamed."""
        return self.used if self.used is not None else self.prompt_tokens + self.completion_seen


class Gate:
    """Identity, policy and the limiter behind one small API for the servicer."""

    def __init__(
        self,
        authenticator: Authenticator,
        policies: PolicyBook,
        limiter: RateLimiter | None,
        *,
        refused_serial_s: float = 10.0,
        speculative_starts: int = 1,
    ) -> None:
        self._auth = authenticator
        self._policies = policies
        self._limiter = limiter
        self._refused_serial_s = refused_serial_s
        self._speculative_starts = speculative_starts
        self._speculating: dict[str, int] = {}  # tenant -> its requests started before their admission
        self._refused: OrderedDict[str, float] = OrderedDict()  # tenant -> monotonic time of its last refusal
        self._settling: set[asyncio.Task[None]] = set()
        self._changed = asyncio.Condition()
        self.settled = 0
        """Settlements finished so far (tests wait on it with :meth:`wait_settled`)."""
        self.on_close: list[Callable[[], Awaitable[object]]] = []
        """Called by :meth:`close` after the limiter (the key store's own client, when in another Redis)."""

    async def identify(self, metadata: Iterable[tuple[str, str | bytes]]) -> Identity:
        with tracing.span("gateway.auth"):
            return await self._auth.authenticate(metadata)

    def recently_refused(self, tenant: str) -> bool:
        """Whether ``tenant`` hit a rate limit in the last ``refused_serial_s`` (its requests are then
        admitted before any routing work starts: an over-limit flood costs the workers nothing)."""
        at = self._refused.get(tenant)
        return at is not None and time.monotonic() - at < self._refused_serial_s

    def speculate(self, tenant: str) -> bool:
        """Whether a request of ``tenant`` may start on a worker before its reservation is known.

        At most ``speculative_starts`` per tenant at a time on this gateway, and never for a tenant
        refused in the last ``refused_serial_s``: a refused request costs a worker at most a
        prefill's start, and a tenant over its limit costs nothing. Call :meth:`speculation_over`
        once the reservation is known.
        """
        held = self._speculating.get(tenant, 0)
        if held >= self._speculative_starts or self.recently_refused(tenant):
            return False
        self._speculating[tenant] = held + 1
        return True

    def speculation_over(self, tenant: str, admitted: bool) -> None:
        SPECULATIVE_STARTS.labels("gateway", "admitted" if admitted else "refused").inc()
        held = self._speculating.get(tenant, 0) - 1
        if held > 0:
            self._speculating[tenant] = held
        else:
            self._speculating.pop(tenant, None)

    def _note_refused(self, tenant: str) -> None:
        self._refused[tenant] = time.monotonic()
        self._refused.move_to_end(tenant)
        if len(self._refused) > _REFUSED_TENANTS:
            self._refused.popitem(last=False)

    def policy(self, identity: Identity) -> TenantPolicy:
        return self._policies.for_tenant(identity.tenant, identity.limits)

    async def admit(
        self,
        identity: Identity,
        policy: TenantPolicy,
        prompt_texts: Iterable[str],
        max_tokens: int,
        *,
        stream_ttl_s: float | None = None,
        count_request: bool = True,
        embed_tokens: int | None = None,
    ) -> Ticket:
        """Check the request against ``policy`` and reserve its budget; raises on a limit.

        ``max_tokens`` 0 (the model's default) reserves the tenant's ``max_tokens`` cap.
        ``embed_tokens``: an Embed request, which generates nothing: its budget is its texts' estimate
        plus this many token ids (its token id inputs), and ``max_tokens`` is ignored.
        """
        prompt_tokens = estimate_prompt_tokens(prompt_texts)
        budget = max_tokens or policy.max_tokens
        if embed_tokens is not None:  # the per-input limit: check_embed_inputs
            prompt_tokens, budget = prompt_tokens + embed_tokens, 0
            if count_request and policy.tokens_per_minute and prompt_tokens > policy.tokens_per_minute:
                raise InvalidArgument(
                    f"the inputs are about {prompt_tokens} tokens, more than your {policy.tokens_per_minute}"
                    " tokens per minute; split the request"
                )
        elif count_request:
            check_request(policy, prompt_tokens, budget)
        ticket = Ticket(policy, prompt_tokens if count_request else 0)
        if self._limiter is not None:
            with tracing.span("gateway.rate_limit"):
                try:
                    ticket.reservation = await self._limiter.admit(
                        identity.tenant,
                        policy,
                        tokens=prompt_tokens + budget if count_request else 0,
                        count_request=count_request,
                        stream_ttl_s=stream_ttl_s,
                    )
                except ResourceExhausted:
                    self._note_refused(identity.tenant)
                    raise
        if count_request:
            ADMITTED.labels("gateway", identity.tenant, identity.source).inc()
        return ticket

    def settle_soon(self, ticket: Ticket) -> None:
        """Settle ``ticket`` with its usage in a task of its own (survives the call's cancellation).

        Idempotent: only the first call for a ticket settles it.
        """
        if self._limiter is None or ticket.reservation is None or ticket.settling:
            return
        ticket.settling = True
        task = asyncio.create_task(self._settle(self._limiter, ticket.reservation, ticket.tokens_used()))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle(self, limiter: RateLimiter, reservation: Reservation, used: int) -> None:
        try:
            await limiter.settle(reservation, used)
        finally:
            self.settled += 1
            async with self._changed:
                self._changed.notify_all()

    async def wait_settled(self, count: int) -> None:
        """Return once ``count`` settlements have finished."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.settled >= count)

    async def drain(self) -> None:
        """Wait for pending settlements (at shutdown, and in tests)."""
        while self._settling:
            await asyncio.gather(*list(self._settling), return_exceptions=True)

    async def close(self) -> None:
        await self.drain()
        if self._limiter is not None:
            await self._limiter.close()
        for close in self.on_close:
            await close()
