"""Gate: a tenant refused by the limiter is remembered for ``refused_serial_s`` (its requests are then
admitted before routing starts), other tenants are not affected, and the memory is bounded."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from services.common.errors import ResourceExhausted
from services.gateway import admission
from services.gateway.admission import Gate
from services.gateway.identity import Authenticator, Identity
from services.gateway.policy import PolicyBook, TenantPolicy
from services.gateway.ratelimit import Reservation


class RefusingLimiter:
    """Refuses the tenants in ``refuse``; admits everyone else."""

    def __init__(self, refuse: set[str]) -> None:
        self.refuse = refuse

    async def admit(self, tenant, policy, *, tokens, count_request, stream_ttl_s):  # type: ignore[no-untyped-def]
        if tenant in self.refuse:
            raise ResourceExhausted(f"rate limit: tenant {tenant} is over its limit", 500)
        return Reservation(tenant, tokens, policy.tokens_per_minute, "")


def _gate(refuse: set[str], serial_s: float = 10.0) -> Gate:
    return Gate(Authenticator(), PolicyBook(TenantPolicy()), RefusingLimiter(refuse), refused_serial_s=serial_s)  # type: ignore[arg-type]


async def _admit(gate: Gate, tenant: str) -> None:
    who = Identity(tenant, f"static:{tenant}", "static")
    await gate.admit(who, gate.policy(who), ["hello"], 8)


async def test_a_refused_tenant_is_remembered_and_others_are_not() -> None:
    gate = _gate({"flood"})
    assert not gate.recently_refused("flood")
    with pytest.raises(ResourceExhausted):
        await _admit(gate, "flood")
    await _admit(gate, "calm")
    assert gate.recently_refused("flood")
    assert not gate.recently_refused("calm")


async def test_the_memory_expires() -> None:
    gate = _gate({"flood"}, serial_s=0.0)
    with pytest.raises(ResourceExhausted):
        await _admit(gate, "flood")
    assert not gate.recently_refused("flood")


async def test_the_memory_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "_REFUSED_TENANTS", 3)
    tenants = [f"t{i}" for i in range(5)]
    gate = _gate(set(tenants))
    for tenant in tenants:
        with pytest.raises(ResourceExhausted):
            await _admit(gate, tenant)
    assert [gate.recently_refused(t) for t in tenants] == [False, False, True, True, True]


def _speculative(outcome: str) -> float:
    labels = {"service": "gateway", "outcome": outcome}
    value = REGISTRY.get_sample_value("meshserve_gateway_speculative_starts_total", labels)
    return value or 0.0


async def test_speculative_starts_are_bounded_per_tenant_and_given_back() -> None:
    gate = Gate(Authenticator(), PolicyBook(TenantPolicy()), RefusingLimiter(set()), speculative_starts=2)  # type: ignore[arg-type]
    assert gate.speculate("a") and gate.speculate("a")
    assert not gate.speculate("a"), "a third request of the tenant waits for its reservation"
    assert gate.speculate("b"), "other tenants have their own allowance"
    refused_before = _speculative("refused")
    gate.speculation_over("a", admitted=False)
    assert _speculative("refused") == refused_before + 1
    assert gate.speculate("a")
    for _ in range(2):
        gate.speculation_over("a", admitted=True)
    gate.speculation_over("b", admitted=True)
    assert gate._speculating == {}, "no memory is kept for tenants with nothing in flight"


async def test_no_speculative_start_for_a_tenant_refused_lately_or_when_disabled() -> None:
    gate = _gate({"flood"})
    with pytest.raises(ResourceExhausted):
        await _admit(gate, "flood")
    assert not gate.speculate("flood")
    assert gate.speculate("calm")
    off = Gate(Authenticator(), PolicyBook(TenantPolicy()), RefusingLimiter(set()), speculative_starts=0)  # type: ignore[arg-type]
    assert not off.speculate("calm")
