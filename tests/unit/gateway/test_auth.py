"""API-key parsing, hashing, metadata extraction and the constant-time lookup."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from services.common.config import load_settings
from services.common.errors import ConfigError, Unauthenticated
from services.gateway import auth
from services.gateway.auth import ApiKeyAuthenticator, hash_api_key, parse_api_keys, presented_key
from services.gateway.config import GatewaySettings

ACME = hash_api_key("acme-key")
GLOBEX = hash_api_key("globex-key")


def test_hash_is_sha256_hex() -> None:
    assert hash_api_key("k") == hashlib.sha256(b"k").hexdigest()


def test_parse_entries_with_spaces_and_upper_case_hex() -> None:
    keys = parse_api_keys(f" acme:{ACME} , globex:{GLOBEX.upper()},")
    assert [(k.tenant, k.digest.hex()) for k in keys] == [("acme", ACME), ("globex", GLOBEX)]
    assert parse_api_keys("") == ()


def test_parse_an_entry_limited_to_models() -> None:
    keys = parse_api_keys(f"acme:{ACME}:m1|org/m:2 , globex:{GLOBEX}")
    assert [(k.tenant, k.models) for k in keys] == [("acme", ("m1", "org/m:2")), ("globex", ())]
    assert ApiKeyAuthenticator(keys).key_for("acme-key").models == ("m1", "org/m:2")
    with pytest.raises(ValueError, match="names no model"):
        parse_api_keys(f"acme:{ACME}:")


@pytest.mark.parametrize(
    "spec", ["acme", f":{ACME}", "acme:abc", f"ac me:{ACME}", f"acme:{ACME}0", f"acme={ACME}", f"acme:{ACME}x"]
)
def test_parse_rejects_malformed_entries_with_a_fix(spec: str) -> None:
    with pytest.raises(ValueError, match="tenant:sha256hex"):
        parse_api_keys(spec)


def test_settings_report_bad_api_keys_by_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSERVE_GATEWAY_API_KEYS", "acme:not-a-hash")
    with pytest.raises(ConfigError, match="MESHSERVE_GATEWAY_API_KEYS"):
        load_settings(GatewaySettings)


def test_settings_parse_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSERVE_GATEWAY_API_KEYS", f"acme:{ACME}")
    monkeypatch.setenv("MESHSERVE_GATEWAY_ROUTER_ADDRESS", "10.0.0.1:7000")
    settings = load_settings(GatewaySettings)
    assert settings.router_address == "10.0.0.1:7000" and parse_api_keys(settings.api_keys)[0].tenant == "acme"


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ((("authorization", "Bearer abc"),), "abc"),
        ((("authorization", "bearer   abc  "),), "abc"),
        ((("x-api-key", "abc"),), "abc"),
        ((("x-api-key", "header"), ("authorization", "Bearer bearer")), "bearer"),
        ((("authorization", "Basic abc"),), None),
        ((("authorization", "Bearer "),), None),
        ((("x-api-key", b"bytes"),), None),
        ((), None),
    ],
)
def test_presented_key(metadata: tuple[tuple[str, str | bytes], ...], expected: str | None) -> None:
    assert presented_key(metadata) == expected


def test_authenticate_resolves_tenant_by_either_header() -> None:
    authn = ApiKeyAuthenticator(parse_api_keys(f"acme:{ACME},globex:{GLOBEX}"))
    assert authn.authenticate((("authorization", "Bearer globex-key"),)) == "globex"
    assert authn.authenticate({"x-api-key": "acme-key"}) == "acme"


@pytest.mark.parametrize("metadata", [(), (("x-api-key", "nope"),), (("authorization", "Bearer acme-key2"),)])
def test_unknown_or_missing_key_is_unauthenticated(metadata: tuple[tuple[str, str], ...]) -> None:
    authn = ApiKeyAuthenticator(parse_api_keys(f"acme:{ACME}"))
    with pytest.raises(Unauthenticated) as err:
        authn.authenticate(metadata)
    assert "\n" not in err.value.message and "acme" not in err.value.message


def test_every_configured_digest_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A match on the first key must not short-cut the comparisons against the others."""
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    authn = ApiKeyAuthenticator(parse_api_keys(f"acme:{ACME},globex:{GLOBEX},third:{hash_api_key('x')}"))
    assert authn.tenant_for_key("acme-key") == "acme"
    assert len(calls) == 3
    assert all(a == hashlib.sha256(b"acme-key").digest() for a, _ in calls), "only digests are compared"
