"""JWT bearer verification with keys generated in the test (HS256 secret, RS256/ES256 JWKS)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from services.common.errors import ConfigError, Unauthenticated
from services.gateway.jwt_auth import JwtVerifier, looks_like_jwt

SECRET = "s3cret-s3cret-s3cret-s3cret-s3cret"
RSA_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
EC_KEY = ec.generate_private_key(ec.SECP256R1())


def jwks() -> dict[str, Any]:
    keys = []
    for kid, key, alg in (("rsa1", RSA_KEY, "RS256"), ("ec1", EC_KEY, "ES256")):
        algo = jwt.get_algorithm_by_name(alg)
        jwk = json.loads(algo.to_jwk(key.public_key()))
        keys.append({**jwk, "kid": kid, "alg": alg, "use": "sig"})
    return {"keys": keys}


def claims(**over: Any) -> dict[str, Any]:
    now = int(time.time())
    base = {"sub": "user-1", "tenant": "acme", "aud": "meshserve", "iss": "idp", "exp": now + 300, "nbf": now - 5}
    base.update(over)
    return {k: v for k, v in base.items() if v is not None}


@pytest.fixture
def verifier() -> JwtVerifier:
    return JwtVerifier(hs256_secret=SECRET, jwks=jwks(), audience="meshserve", issuer="idp", leeway_s=0)


def test_valid_tokens_of_each_algorithm_resolve_the_tenant(verifier: JwtVerifier) -> None:
    hs = jwt.encode(claims(scope="generate chat"), SECRET, algorithm="HS256")
    rs = jwt.encode(claims(tenant="globex"), RSA_KEY, algorithm="RS256", headers={"kid": "rsa1"})
    es = jwt.encode(claims(tenant="initech"), EC_KEY, algorithm="ES256", headers={"kid": "ec1"})
    assert verifier.verify(hs).tenant == "acme"
    assert verifier.verify(hs).scopes == ("generate", "chat")
    assert verifier.verify(rs).tenant == "globex"
    assert verifier.verify(es).subject == "user-1"
    assert looks_like_jwt(hs) and not looks_like_jwt("msk_0123456789ab_secret")


def test_the_models_claim_limits_a_token_to_model_ids(verifier: JwtVerifier) -> None:
    assert verifier.verify(jwt.encode(claims(), SECRET, algorithm="HS256")).models == ()
    listed = jwt.encode(claims(models=["m1", "org/m2"]), SECRET, algorithm="HS256")
    assert verifier.verify(listed).models == ("m1", "org/m2")
    spaced = jwt.encode(claims(models="m1 m2"), SECRET, algorithm="HS256")
    assert verifier.verify(spaced).models == ("m1", "m2")
    other = JwtVerifier(hs256_secret=SECRET, audience="meshserve", models_claim="https://x/models")
    named = jwt.encode(claims(**{"https://x/models": ["m3"]}), SECRET, algorithm="HS256")
    assert other.verify(named).models == ("m3",)
    for bad in ([], "", [""], [1], {"m": 1}, 5):
        with pytest.raises(Unauthenticated, match="'models' claim must be a non-empty list"):
            verifier.verify(jwt.encode(claims(models=bad), SECRET, algorithm="HS256"))


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda: jwt.encode(claims(), "another-secret-of-enough-length!!", algorithm="HS256"), "signature"),
        (lambda: jwt.encode(claims(exp=int(time.time()) - 10), SECRET, algorithm="HS256"), "expired"),
        (lambda: jwt.encode(claims(nbf=int(time.time()) + 600), SECRET, algorithm="HS256"), "not valid yet"),
        (lambda: jwt.encode(claims(aud="someone-else"), SECRET, algorithm="HS256"), "audience"),
        (lambda: jwt.encode(claims(iss="evil"), SECRET, algorithm="HS256"), "issuer"),
        (lambda: jwt.encode(claims(exp=None), SECRET, algorithm="HS256"), "exp"),
        (lambda: jwt.encode(claims(aud=None), SECRET, algorithm="HS256"), "aud"),
        (lambda: jwt.encode(claims(tenant=None), SECRET, algorithm="HS256"), "tenant"),
        (lambda: jwt.encode(claims(tenant="a b"), SECRET, algorithm="HS256"), "tenant"),
        (lambda: jwt.encode(claims(), None, algorithm="none"), "algorithm"),
        (
            lambda: jwt.encode(
                claims(), rsa.generate_private_key(65537, 2048), algorithm="RS256", headers={"kid": "rsa1"}
            ),
            "signature",
        ),
        (lambda: jwt.encode(claims(), RSA_KEY, algorithm="RS256", headers={"kid": "unknown"}), "kid"),
        (lambda: "eyJhbGciOi.not-a.token", "well-formed"),
    ],
    ids=[
        "forged",
        "expired",
        "nbf",
        "wrong-aud",
        "wrong-iss",
        "no-exp",
        "no-aud",
        "no-tenant",
        "bad-tenant",
        "alg-none",
        "rsa-forged",
        "unknown-kid",
        "garbage",
    ],
)
def test_bad_tokens_are_unauthenticated_with_the_reason(verifier: JwtVerifier, make: Any, why: str) -> None:
    with pytest.raises(Unauthenticated, match=why):
        verifier.verify(make())


def test_hs256_token_signed_with_the_public_key_is_refused_without_a_secret() -> None:
    """Algorithm confusion: an RS256-only gateway must not accept HS256 keyed by its public key."""
    only_rsa = JwtVerifier(jwks=jwks())
    pem = RSA_KEY.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    signing_input = b64(b'{"alg":"HS256","typ":"JWT"}') + "." + b64(json.dumps(claims()).encode())
    signature = hmac.new(pem, signing_input.encode(), hashlib.sha256).digest()
    with pytest.raises(Unauthenticated, match="algorithm"):
        only_rsa.verify(signing_input + "." + b64(signature))


def test_from_files_reads_a_jwks_file_and_reports_a_bad_one(tmp_path: Path) -> None:
    assert JwtVerifier.from_files() is None
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps(jwks()))
    verifier = JwtVerifier.from_files(jwks_file=str(path))
    assert verifier is not None
    token = jwt.encode(claims(aud=None, iss=None), EC_KEY, algorithm="ES256", headers={"kid": "ec1"})
    assert verifier.verify(token).tenant == "acme"
    with pytest.raises(ConfigError, match="jwt_jwks_file"):
        JwtVerifier.from_files(jwks_file=str(tmp_path / "missing.json"))
