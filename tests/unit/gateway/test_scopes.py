"""Scopes: which credential may call which method, and how key creation checks scope names."""

from __future__ import annotations

import pytest

from services.common.errors import PermissionDenied
from services.gateway import scopes
from services.gateway.keycache import KeyRecordCache
from services.gateway.keystore import KeyRecord

METHODS = ("Generate", "Complete", "Chat", "ListModels")


@pytest.mark.parametrize("method", METHODS)
def test_inference_and_star_grant_every_method(method: str) -> None:
    scopes.require(method, ("inference",), "k1")
    scopes.require(method, ("*",), "k1")


@pytest.mark.parametrize("method", ["Generate", "Complete", "Chat"])
def test_models_read_only_lists_models(method: str) -> None:
    scopes.require("ListModels", ("models:read",), "k1")
    with pytest.raises(PermissionDenied) as info:
        scopes.require(method, ("models:read",), "k1")
    assert "k1" in info.value.message and "inference" in info.value.message and method in info.value.message


def test_unrelated_scopes_grant_nothing() -> None:
    for method in METHODS:
        with pytest.raises(PermissionDenied):
            scopes.require(method, ("openid", "profile"), "jwt:svc")


def test_a_credential_naming_no_scopes_gets_inference() -> None:
    assert scopes.effective(()) == ("inference",)
    assert scopes.effective(("", "")) == ("inference",)
    assert scopes.effective(("models:read",)) == ("models:read",)


def test_unknown_scope_names_are_refused_at_creation() -> None:
    assert scopes.check_known([" inference ", "models:read", ""]) == ("inference", "models:read")
    with pytest.raises(ValueError, match="unknown scope 'admin'"):
        scopes.check_known(["inference", "admin"])


def _record(key_id: str) -> KeyRecord:
    return KeyRecord(key_id=key_id, tenant="acme", digest=key_id * 4)


def test_key_cache_serves_a_record_until_its_ttl_then_forgets_it() -> None:
    now = [100.0]
    cache = KeyRecordCache(ttl_s=1.0, clock=lambda: now[0])
    cache.put("d1", _record("a"))
    now[0] = 100.9
    assert cache.get("d1") == _record("a")
    now[0] = 101.0
    assert cache.get("d1") is None
    assert len(cache) == 0


def test_key_cache_is_bounded_and_drops_the_oldest_first() -> None:
    cache = KeyRecordCache(ttl_s=10.0, max_entries=2, clock=lambda: 0.0)
    for name in ("a", "b", "c"):
        cache.put(name, _record(name))
    assert len(cache) == 2
    assert cache.get("a") is None and cache.get("c") == _record("c")


def test_key_cache_with_zero_ttl_holds_nothing() -> None:
    cache = KeyRecordCache(ttl_s=0.0)
    cache.put("d1", _record("a"))
    assert cache.get("d1") is None
