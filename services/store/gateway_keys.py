"""Redis key schema of the gateway's data: API-key records and rate-limit buckets.

Like every key of meshserve these live under ``meshserve:v1:``. Layout::

    meshserve:v1:apikey:<sha256 hex of the key>       hash: the key's record (tenant, scopes, ...)
    meshserve:v1:apikey-id:<key id>                   string: that key's sha256 hex (for revoke/list)
    meshserve:v1:rl:{t:<tenant>}:req                  hash: request token bucket (tokens, ts)
    meshserve:v1:rl:{t:<tenant>}:tok                  hash: LLM-token bucket (tokens, ts)
    meshserve:v1:rl:{t:<tenant>}:streams              zset: open stream leases, score = expiry ms

The ``{t:<tenant>}`` hash tag puts all of one tenant's limiter keys in one Redis Cluster slot, so
the admission script (which touches all three) runs atomically on Cluster too. API-key records are
read one key at a time, so they carry no tag.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.store.keys import NAMESPACE

API_KEY_PREFIX = f"{NAMESPACE}:apikey"
API_KEY_ID_PREFIX = f"{NAMESPACE}:apikey-id"
RATE_LIMIT_PREFIX = f"{NAMESPACE}:rl"


def api_key_record(digest_hex: str) -> str:
    """Key of the record of the API key whose SHA-256 (hex) is ``digest_hex``."""
    return f"{API_KEY_PREFIX}:{digest_hex.lower()}"


def api_key_id(key_id: str) -> str:
    """Key that maps a public key id to its digest (what ``keys revoke`` and ``keys list`` use)."""
    return f"{API_KEY_ID_PREFIX}:{key_id}"


def api_key_id_pattern() -> str:
    """SCAN pattern matching every key-id entry."""
    return f"{API_KEY_ID_PREFIX}:*"


def tenant_tag(tenant: str) -> str:
    """The Cluster hash tag of one tenant's limiter keys."""
    return "{t:" + tenant + "}"


@dataclass(frozen=True)
class RateLimitKeys:
    """The three limiter keys of one tenant, in the order the admission script takes them."""

    requests: str
    tokens: str
    streams: str

    def as_list(self) -> list[str]:
        return [self.requests, self.tokens, self.streams]


def rate_limit_keys(tenant: str) -> RateLimitKeys:
    """Limiter keys of ``tenant`` (all in one Cluster slot)."""
    base = f"{RATE_LIMIT_PREFIX}:{tenant_tag(tenant)}"
    return RateLimitKeys(requests=f"{base}:req", tokens=f"{base}:tok", streams=f"{base}:streams")
