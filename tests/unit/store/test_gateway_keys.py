"""Key schema of the gateway's Redis data: namespaced, one Cluster slot per tenant's limiter keys."""

from __future__ import annotations

from redis.crc import key_slot

from services.store import gateway_keys as gk


def test_limiter_keys_of_one_tenant_share_a_cluster_slot_and_tenants_differ() -> None:
    acme = gk.rate_limit_keys("acme")
    assert all(k.startswith("meshserve:v1:rl:{t:acme}:") for k in acme.as_list())
    assert len({key_slot(k.encode()) for k in acme.as_list()}) == 1
    assert gk.rate_limit_keys("globex").requests != acme.requests


def test_api_key_records_are_namespaced_by_digest_and_id() -> None:
    digest = "AB" * 32
    assert gk.api_key_record(digest) == f"meshserve:v1:apikey:{digest.lower()}"
    assert gk.api_key_id("0123456789ab") == "meshserve:v1:apikey-id:0123456789ab"
    assert gk.api_key_id_pattern() == "meshserve:v1:apikey-id:*"
