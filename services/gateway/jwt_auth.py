"""JWT bearer tokens: HS256 with a shared secret, RS256/ES256 with keys from a JWKS file (PyJWT).

Checks: signature, ``exp`` (required), ``nbf``, ``aud`` and ``iss`` when configured (then also
required), with a small leeway for clock skew. The algorithm is chosen by what is configured, never
by the token alone: an HS256 token is only accepted with a shared secret, an RS256/ES256 one only
with a JWKS key of that type (no ``none``, no RSA-key-as-HMAC-secret confusion). PyJWT compares
HMAC signatures in constant time. The tenant comes from a configurable claim; so does the optional
list of model ids the token may use (default claim ``models``: a list of ids, or one space-separated
string; absent: every model), enforced as a stored key's ``--models`` is
(:func:`services.gateway.scopes.require_model`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt

from services.common.errors import ConfigError, Unauthenticated

ASYMMETRIC = ("RS256", "ES256")
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_JWT_SHAPE = re.compile(r"^[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*$")
_INVALID = "invalid bearer token: {why}; get a fresh token from your identity provider"


def looks_like_jwt(token: str) -> bool:
    """True for the three-part base64url shape of a JWS (``msk_`` API keys never match)."""
    return token.startswith("eyJ") and _JWT_SHAPE.match(token) is not None


@dataclass(frozen=True)
class JwtClaims:
    """What a verified JWT grants: the tenant (from the configured claim), its subject, scopes and the
    model ids it may use (empty: every one)."""

    tenant: str
    subject: str
    scopes: tuple[str, ...]
    models: tuple[str, ...] = ()


class JwtVerifier:
    """Verifies bearer JWTs; build with :meth:`from_settings` (None when JWT is not configured)."""

    def __init__(
        self,
        *,
        hs256_secret: str = "",
        jwks: dict[str, Any] | None = None,
        audience: str = "",
        issuer: str = "",
        tenant_claim: str = "tenant",
        models_claim: str = "models",
        leeway_s: float = 30.0,
    ) -> None:
        self._secret = hs256_secret
        self._keys: list[jwt.PyJWK] = []
        if jwks:
            try:
                self._keys = [k for k in jwt.PyJWKSet.from_dict(jwks).keys if k.algorithm_name in ASYMMETRIC]
            except jwt.PyJWKSetError as exc:
                raise ConfigError(f"the JWKS has no usable RS256/ES256 key ({exc}); check jwt_jwks_file") from None
        self._audience = audience or None
        self._issuer = issuer or None
        self._tenant_claim = tenant_claim
        self._models_claim = models_claim
        self._leeway = leeway_s

    @classmethod
    def from_files(cls, *, jwks_file: str = "", **kwargs: Any) -> JwtVerifier | None:
        jwks = None
        if jwks_file:
            try:
                jwks = json.loads(Path(jwks_file).read_text())
            except (OSError, ValueError) as exc:
                raise ConfigError(f"cannot read the JWKS file {jwks_file}: {exc}; fix jwt_jwks_file") from None
        if not jwks and not kwargs.get("hs256_secret"):
            return None
        return cls(jwks=jwks, **kwargs)

    def _key_for(self, header: dict[str, Any]) -> tuple[Any, str]:
        alg = header.get("alg")
        if alg == "HS256" and self._secret:
            return self._secret, alg
        if alg in ASYMMETRIC:
            kid = header.get("kid")
            for key in self._keys:
                if key.algorithm_name == alg and (kid is None or key.key_id == kid):
                    return key.key, alg
            raise Unauthenticated(_INVALID.format(why="no configured key matches its kid/alg"))
        raise Unauthenticated(_INVALID.format(why=f"algorithm {str(alg)[:10]!r} is not accepted"))

    def verify(self, token: str) -> JwtClaims:
        """The claims of a valid token; raises :class:`Unauthenticated` saying why it is not."""
        try:
            header = jwt.get_unverified_header(token)
        except jwt.InvalidTokenError:
            raise Unauthenticated(_INVALID.format(why="it is not a well-formed JWT")) from None
        key, alg = self._key_for(header)
        required = ["exp"] + (["aud"] if self._audience else []) + (["iss"] if self._issuer else [])
        try:
            claims = jwt.decode(
                token,
                key,
                algorithms=[alg],
                audience=self._audience,
                issuer=self._issuer,
                leeway=self._leeway,
                options={"require": required, "verify_aud": self._audience is not None},
            )
        except jwt.ExpiredSignatureError:
            raise Unauthenticated(_INVALID.format(why="it has expired")) from None
        except jwt.ImmatureSignatureError:
            raise Unauthenticated(_INVALID.format(why="it is not valid yet (nbf)")) from None
        except jwt.InvalidAudienceError:
            raise Unauthenticated(_INVALID.format(why="it is for another audience")) from None
        except jwt.InvalidIssuerError:
            raise Unauthenticated(_INVALID.format(why="it comes from an unexpected issuer")) from None
        except jwt.MissingRequiredClaimError as exc:
            raise Unauthenticated(_INVALID.format(why=f"it lacks the {exc.claim} claim")) from None
        except jwt.InvalidTokenError:
            raise Unauthenticated(_INVALID.format(why="its signature does not verify")) from None
        tenant = claims.get(self._tenant_claim)
        if not isinstance(tenant, str) or not _TENANT.match(tenant):
            raise Unauthenticated(_INVALID.format(why=f"its {self._tenant_claim!r} claim is not a tenant id"))
        scope = claims.get("scope", "")
        scopes = tuple(scope.split()) if isinstance(scope, str) else ()
        models = self._models(claims.get(self._models_claim))
        return JwtClaims(tenant=tenant, subject=str(claims.get("sub", ""))[:128], scopes=scopes, models=models)

    def _models(self, value: object) -> tuple[str, ...]:
        """The token's model limit: a list of ids or one space-separated string; None: no limit."""
        if value is None:
            return ()
        ids = value.split() if isinstance(value, str) else value
        if (
            not isinstance(ids, list)
            or not ids
            or not all(isinstance(m, str) and m.strip() and len(m) <= 256 for m in ids)
        ):
            why = f"its {self._models_claim!r} claim must be a non-empty list of model ids (strings)"
            raise Unauthenticated(_INVALID.format(why=why))
        return tuple(m.strip() for m in ids)
