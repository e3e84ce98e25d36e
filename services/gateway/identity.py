"""Who is calling: one entry point over the three credential sources of the gateway.

A bearer token shaped like a JWT goes to the JWT verifier (when configured). Any other key is
checked against the static keys of ``MESHSERVE_GATEWAY_API_KEYS`` (constant time, every digest
compared), then, if it has the ``msk_<id>_<secret>`` shape, against the Redis key store. The result
names the tenant and a key id safe to log (never the key).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import structlog
from redis.exceptions import RedisError

from services.common.errors import Unauthenticated, Unavailable
from services.gateway.auth import ApiKeyAuthenticator, hash_api_key, presented_key
from services.gateway.jwt_auth import JwtVerifier, looks_like_jwt
from services.gateway.keystore import KeyStore, key_id_of

log = structlog.get_logger(__name__)

_MISSING = "missing credentials; send `authorization: Bearer <API key or JWT>` or `x-api-key: <key>` metadata"
_WRONG = "invalid API key; check the key you were given"


@dataclass(frozen=True)
class Identity:
    """An authenticated caller."""

    tenant: str
    key_id: str
    """Loggable id of the credential: ``static:<digest prefix>``, the stored key's id, or ``jwt:<sub>``."""
    source: str
    scopes: tuple[str, ...] = ()
    limits: Mapping[str, int] = field(default_factory=dict)
    """Policy overrides stored on the key (see :mod:`services.gateway.policy`)."""


class Authenticator:
    """Resolves an :class:`Identity` from call metadata, or raises Unauthenticated/Unavailable."""

    def __init__(
        self,
        static: ApiKeyAuthenticator | None = None,
        store: KeyStore | None = None,
        jwt: JwtVerifier | None = None,
    ) -> None:
        self._static = static if static is not None and len(static) else None
        self._store = store
        self._jwt = jwt

    @property
    def configured(self) -> bool:
        return bool(self._static or self._store or self._jwt)

    async def authenticate(self, metadata: Iterable[tuple[str, str | bytes]]) -> Identity:
        token = presented_key(metadata)
        if not token:
            raise Unauthenticated(_MISSING)
        if self._jwt is not None and looks_like_jwt(token):
            claims = self._jwt.verify(token)
            return Identity(claims.tenant, f"jwt:{claims.subject}", "jwt", claims.scopes)
        if self._static is not None:
            try:
                tenant = self._static.tenant_for_key(token)
            except Unauthenticated:
                pass
            else:
                return Identity(tenant, f"static:{hash_api_key(token)[:8]}", "static")
        key_id = key_id_of(token)
        if self._store is None or key_id is None:
            raise Unauthenticated(_WRONG)
        try:
            record = await self._store.lookup(token)
        except (RedisError, OSError) as exc:
            log.warning("key_store_unreachable", error=type(exc).__name__)
            raise Unavailable("cannot check the API key right now (key store unreachable); retry shortly") from None
        if record is None or record.key_id != key_id:
            raise Unauthenticated(_WRONG)
        if record.revoked:
            raise Unauthenticated(f"API key {record.key_id} was revoked; ask for a new key")
        if record.expired():
            raise Unauthenticated(f"API key {record.key_id} has expired; ask for a new key")
        return Identity(record.tenant, record.key_id, "keystore", record.scopes, record.limits)
