"""Tenant policy: defaults, per-tenant and per-key overrides, prompt estimate, request checks."""

from __future__ import annotations

import pytest

from services.common.config import load_settings
from services.common.errors import ConfigError, InvalidArgument
from services.gateway.config import GatewaySettings
from services.gateway.policy import PolicyBook, TenantPolicy, allowed_priority, check_request, estimate_prompt_tokens


def test_overrides_apply_in_order_default_tenant_key() -> None:
    book = PolicyBook(TenantPolicy(requests_per_minute=100), {"acme": {"requests_per_minute": 10, "max_tokens": 64}})
    assert book.for_tenant("other").requests_per_minute == 100
    acme = book.for_tenant("acme", {"max_tokens": 32})
    assert (acme.requests_per_minute, acme.max_tokens, acme.burst) == (10, 32, 10)


@pytest.mark.parametrize("bad", [{"rpm": 5}, {"max_tokens": -1}, {"max_tokens": "x"}])
def test_bad_overrides_are_rejected_with_the_field(bad: dict) -> None:
    with pytest.raises(ValueError, match=r"policy|unknown"):
        TenantPolicy().with_overrides(bad)


def test_settings_parse_tenant_policies_from_json_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSERVE_GATEWAY_TENANT_POLICIES", '{"acme": {"tokens_per_minute": 500}}')
    monkeypatch.setenv("MESHSERVE_GATEWAY_REQUESTS_PER_MINUTE", "7")
    book = load_settings(GatewaySettings).policy_book()
    assert book.for_tenant("acme").tokens_per_minute == 500
    assert book.for_tenant("acme").requests_per_minute == 7
    monkeypatch.setenv("MESHSERVE_GATEWAY_TENANT_POLICIES", '{"acme": {"nope": 1}}')
    with pytest.raises(ConfigError, match="MESHSERVE_GATEWAY_TENANT_POLICIES"):
        load_settings(GatewaySettings)


def test_prompt_estimate_is_high_and_counts_bytes() -> None:
    assert estimate_prompt_tokens(["hello"]) == 2 + 4
    assert estimate_prompt_tokens(["é" * 3]) == 2 + 4  # 6 UTF-8 bytes
    assert estimate_prompt_tokens(["a", "b"]) == 10


def test_request_checks_name_the_limit() -> None:
    policy = TenantPolicy(max_prompt_tokens=100, max_tokens=50, tokens_per_minute=120)
    check_request(policy, 100, 20)
    with pytest.raises(InvalidArgument, match="prompt"):
        check_request(policy, 101, 1)
    with pytest.raises(InvalidArgument, match="max_tokens"):
        check_request(policy, 1, 51)
    with pytest.raises(InvalidArgument, match="tokens per minute"):
        check_request(policy, 100, 50)
    check_request(TenantPolicy(max_prompt_tokens=0, max_tokens=0, tokens_per_minute=0), 10**6, 10**6)


def test_priority_is_capped_at_the_tenant_class() -> None:
    assert allowed_priority(TenantPolicy(priority=3), 9) == 3
    assert allowed_priority(TenantPolicy(priority=3), 1) == 1


def test_embed_inputs_are_checked_one_by_one_against_max_prompt_tokens() -> None:
    from services.gateway.policy import check_embed_inputs

    policy = TenantPolicy(max_prompt_tokens=100)
    check_embed_inputs(policy, ["short"] * 500 + [100])  # many small inputs: each one is a prompt
    with pytest.raises(InvalidArgument, match=r"inputs\[1\] is about 101 tokens, above your limit of 100"):
        check_embed_inputs(policy, [5, 101])
    with pytest.raises(InvalidArgument, match=r"inputs\[0\] is about"):
        check_embed_inputs(policy, ["x" * 1000])
    check_embed_inputs(TenantPolicy(max_prompt_tokens=0), [10**6])  # 0: no limit
