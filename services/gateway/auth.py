"""API-key authentication: keys are stored as SHA-256 hashes and compared in constant time.

Written here rather than taken from a library: grpcio has no API-key auth for servers, and the
check is a dozen lines (hash the presented key, compare it against every configured hash).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from services.common import metadata as md
from services.common.errors import Unauthenticated

_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
_MISSING = "missing API key; send it as `authorization: Bearer <key>` or `x-api-key: <key>` metadata"
_WRONG = "invalid API key; check the key you were given"


@dataclass(frozen=True)
class ApiKey:
    """One accepted key: the tenant it belongs to, the SHA-256 digest of the key and the model ids it
    may use (empty: every one)."""

    tenant: str
    digest: bytes
    models: tuple[str, ...] = ()


def hash_api_key(key: str) -> str:
    """The hex SHA-256 of ``key``, as configured in ``api_keys``."""
    return hashlib.sha256(key.encode()).hexdigest()


def parse_api_keys(spec: str) -> tuple[ApiKey, ...]:
    """Parse ``tenant:sha256hex[:model|model],...``; raises ValueError saying how to fix an entry.

    The optional third part limits the key to those model ids (``|``-separated; a model id may hold
    ``:``), as ``meshserve keys create --models`` limits a stored key."""
    keys: list[ApiKey] = []
    for number, raw in enumerate(spec.split(","), start=1):
        entry = raw.strip()
        if not entry:
            continue
        tenant, sep, rest = entry.partition(":")
        tenant, rest = tenant.strip(), rest.strip()
        digest, limited, listed = rest[:64], rest[64:65], rest[65:]
        if not sep or not _TENANT.match(tenant) or not _HEX64.match(digest) or limited not in ("", ":"):
            raise ValueError(
                f"api_keys entry {number} must be `tenant:sha256hex` or `tenant:sha256hex:model|model` (tenant of "
                "letters, digits, _ . -; 64 hex digits of the key's SHA-256; the model ids the key may use)"
            )
        models = tuple(m.strip() for m in listed.split("|") if m.strip())
        if limited and not models:
            raise ValueError(
                f"api_keys entry {number} ends with `:` but names no model; list them as a|b, or drop the `:`"
            )
        keys.append(ApiKey(tenant, bytes.fromhex(digest), models))
    return tuple(keys)


def presented_key(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    """The API key in the call's metadata: ``authorization: Bearer <key>`` first, else ``x-api-key``."""
    bearer: str | None = None
    header: str | None = None
    for name, value in metadata:
        if not isinstance(value, str):
            continue
        if name == md.AUTHORIZATION:
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                bearer = token.strip()
        elif name == md.API_KEY and value.strip():
            header = value.strip()
    return bearer or header


class ApiKeyAuthenticator:
    """Resolves a call's tenant from its API key, or raises :class:`Unauthenticated`."""

    def __init__(self, keys: Iterable[ApiKey]) -> None:
        self._keys = tuple(keys)

    def __len__(self) -> int:
        return len(self._keys)

    def tenant_for_key(self, key: str | None) -> str:
        """The tenant owning ``key``. Every configured digest is compared, so timing leaks nothing."""
        return self.key_for(key).tenant

    def key_for(self, key: str | None) -> ApiKey:
        """The configured entry of ``key`` (tenant, model limit); every digest is compared, as above."""
        if not key:
            raise Unauthenticated(_MISSING)
        presented = hashlib.sha256(key.encode()).digest()
        found: ApiKey | None = None
        for candidate in self._keys:
            if hmac.compare_digest(presented, candidate.digest) and found is None:
                found = candidate
        if found is None:
            raise Unauthenticated(_WRONG)
        return found

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | Mapping[str, str]) -> str:
        """The tenant of the call whose invocation metadata is ``metadata``."""
        pairs = metadata.items() if isinstance(metadata, Mapping) else metadata
        return self.tenant_for_key(presented_key(pairs))
