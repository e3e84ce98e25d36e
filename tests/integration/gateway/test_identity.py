"""Credentials through a real gateway with real Redis: stored API keys, JWTs, static keys."""

from __future__ import annotations

import time

import grpc
import jwt
import pytest
import redis.asyncio as aioredis

from services.cli.keys import main as keys_main
from services.common import metadata as md
from services.common.errors import Unauthenticated
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.gateway.identity import Authenticator
from services.gateway.keycache import KeyRecordCache
from services.gateway.keystore import KeyStore
from tests.integration.gateway.conftest import KEYS, LIMITED_KEY, Gateways, StartFn

pytestmark = pytest.mark.integration

SECRET = "hs256-test-secret-of-enough-length"


def token(**over: object) -> str:
    claims = {"sub": "svc-7", "tenant": "umbrella", "aud": "meshserve", "exp": int(time.time()) + 300, **over}
    return jwt.encode(claims, SECRET, algorithm="HS256")


async def call(mesh: Gateways, credential: str, max_tokens: int = 4) -> grpc.StatusCode:
    reply = mesh.stubs[0].Complete(
        pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=max_tokens)),
        metadata=((md.AUTHORIZATION, f"Bearer {credential}"),),
    )
    try:
        await reply
    except grpc.aio.AioRpcError as exc:
        assert exc.code() != grpc.StatusCode.INTERNAL
        return exc.code()
    return grpc.StatusCode.OK


@pytest.fixture
async def mesh(start: StartFn) -> Gateways:
    # No key cache: a revocation is seen by the very next request (the cache is tested below).
    return await start(1, jwt_hs256_secret=SECRET, jwt_audience="meshserve", key_cache_ttl_s=0)


@pytest.fixture
async def store(redis_url: str):
    client = aioredis.Redis.from_url(redis_url)
    yield KeyStore(client)
    await client.aclose()


async def test_stored_key_authenticates_binds_tenant_and_key_id_then_revocation_refuses_it(
    mesh: Gateways, store: KeyStore
) -> None:
    plaintext, record = await store.create("initech", name="ci")
    assert await call(mesh, plaintext) == grpc.StatusCode.OK
    seen = mesh.router.seen[-1].metadata
    assert (seen[md.TENANT], seen[md.KEY_ID]) == ("initech", record.key_id)
    assert plaintext not in str(await store._client.hgetall(f"meshserve:v1:apikey:{record.digest}"))
    assert await store.revoke(record.key_id)
    assert await call(mesh, plaintext) == grpc.StatusCode.UNAUTHENTICATED


async def test_unknown_expired_and_tampered_keys_are_unauthenticated(mesh: Gateways, store: KeyStore) -> None:
    plaintext, _ = await store.create("initech", ttl_s=0.001)
    assert await call(mesh, plaintext) == grpc.StatusCode.UNAUTHENTICATED  # expired
    good, record = await store.create("initech")
    assert await call(mesh, good[:-1] + ("A" if good[-1] != "A" else "B")) == grpc.StatusCode.UNAUTHENTICATED
    assert await call(mesh, f"msk_{record.key_id}_not-the-secret") == grpc.StatusCode.UNAUTHENTICATED
    assert await call(mesh, "msk_0123456789ab_unknown") == grpc.StatusCode.UNAUTHENTICATED
    assert await call(mesh, KEYS["acme"]) == grpc.StatusCode.OK, "static keys keep working beside the store"


async def test_limits_stored_on_a_key_override_the_tenant_policy(mesh: Gateways, store: KeyStore) -> None:
    plaintext, _ = await store.create("hooli", limits={"requests_per_minute": 1, "max_tokens": 16})
    assert await call(mesh, plaintext, max_tokens=32) == grpc.StatusCode.INVALID_ARGUMENT
    assert await call(mesh, plaintext) == grpc.StatusCode.OK
    assert await call(mesh, plaintext) == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_jwt_authenticates_and_bad_jwts_are_unauthenticated(mesh: Gateways) -> None:
    assert await call(mesh, token()) == grpc.StatusCode.OK
    seen = mesh.router.seen[-1].metadata
    assert (seen[md.TENANT], seen[md.KEY_ID]) == ("umbrella", "jwt:svc-7")
    forged = jwt.encode({"tenant": "umbrella", "aud": "meshserve", "exp": int(time.time()) + 60}, "x" * 40)
    for bad in (forged, token(exp=int(time.time()) - 120), token(aud="other")):
        assert await call(mesh, bad) == grpc.StatusCode.UNAUTHENTICATED
    assert len(mesh.router.seen) == 1


def test_keys_cli_creates_lists_and_revokes(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert keys_main(["--redis-url", redis_url, "create", "--tenant", "acme", "--tokens-per-minute", "500"]) == 0
    out = capsys.readouterr().out
    key_id = out.split("key id:")[1].split()[0]
    plaintext = out.split("api key:")[1].split()[0]
    assert plaintext.startswith(f"msk_{key_id}_")
    assert keys_main(["--redis-url", redis_url, "list", "--json"]) == 0
    listed = capsys.readouterr().out
    assert key_id in listed and plaintext not in listed and '"tokens_per_minute": 500' in listed
    assert keys_main(["--redis-url", redis_url, "revoke", key_id]) == 0
    assert keys_main(["--redis-url", redis_url, "list"]) == 0
    assert "revoked" in capsys.readouterr().out
    assert keys_main(["--redis-url", redis_url, "revoke", "ffffffffffff"]) == 1


@pytest.mark.parametrize("method", ["Complete", "Generate"])
async def test_bad_utf8_in_a_request_is_invalid_argument_not_internal(mesh: Gateways, method: str) -> None:
    bad_prompt = b"\x12\x03\xff\xfeA"  # field 2 (prompt) holding bytes that are not UTF-8
    async with grpc.aio.insecure_channel(f"127.0.0.1:{mesh.servers[0].port}") as channel:
        kind = channel.unary_unary if method == "Complete" else channel.unary_stream
        raw_call = kind(f"/meshserve.v1.Inference/{method}", request_serializer=lambda b: b)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            result = raw_call(bad_prompt, metadata=((md.API_KEY, KEYS["acme"]),))
            if method == "Complete":
                await result
            else:
                async for _ in result:
                    pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in (err.value.details() or "")
    assert mesh.router.seen == []


async def _denied(coro: object) -> grpc.StatusCode:
    try:
        await coro  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        assert "inference scope" in (exc.details() or "")
        return exc.code()
    return grpc.StatusCode.OK


async def test_scopes_are_enforced_per_method_and_denied_calls_never_reach_the_router(
    mesh: Gateways, store: KeyStore
) -> None:
    reader, record = await store.create("initech", scopes=["models:read"])
    assert record.scopes == ("models:read",)
    meta = ((md.AUTHORIZATION, f"Bearer {reader}"),)
    stub = mesh.stubs[0]
    models = await stub.ListModels(pb.ListModelsRequest(), metadata=meta)
    assert models.models[0].id == "fake-model"
    request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=4))
    assert await _denied(stub.Complete(request, metadata=meta)) == grpc.StatusCode.PERMISSION_DENIED

    async def first_frame() -> None:
        async for _ in stub.Generate(request, metadata=meta):
            pass

    assert await _denied(first_frame()) == grpc.StatusCode.PERMISSION_DENIED
    chat = stub.Chat(metadata=meta)
    assert await _denied(chat.read()) == grpc.StatusCode.PERMISSION_DENIED
    assert [seen.method for seen in mesh.router.seen] == ["ListModels"]

    default, record = await store.create("initech")
    assert record.scopes == ("inference",)
    assert await call(mesh, default) == grpc.StatusCode.OK
    everything, _ = await store.create("initech", scopes=["*"])
    assert await call(mesh, everything) == grpc.StatusCode.OK
    with pytest.raises(ValueError, match="unknown scope"):
        await store.create("initech", scopes=["admin"])


async def test_jwt_scope_claim_is_enforced(mesh: Gateways) -> None:
    assert await call(mesh, token(scope="openid inference")) == grpc.StatusCode.OK
    assert await call(mesh, token(scope="models:read")) == grpc.StatusCode.PERMISSION_DENIED
    assert await call(mesh, token()) == grpc.StatusCode.OK, "no scope claim means the default, inference"


async def test_gateway_reuses_a_verified_key_without_asking_redis_again(
    start: StartFn, store: KeyStore, redis_url: str
) -> None:
    mesh = await start(1, key_cache_ttl_s=60)
    plaintext, _ = await store.create("initech")

    async def lookups() -> int:
        stats = await store._client.info("commandstats")
        return int(stats.get("cmdstat_hgetall", {}).get("calls", 0))

    before = await lookups()
    for _ in range(3):
        assert await call(mesh, plaintext) == grpc.StatusCode.OK
    assert await lookups() == before + 1
    assert await call(mesh, "msk_0123456789ab_unknown") == grpc.StatusCode.UNAUTHENTICATED
    assert await call(mesh, "msk_0123456789ab_unknown") == grpc.StatusCode.UNAUTHENTICATED
    assert await lookups() == before + 3, "unknown keys are never cached"


async def test_a_revoked_key_is_refused_once_its_cached_record_expires(store: KeyStore) -> None:
    now = [0.0]
    authenticator = Authenticator(store=store, key_cache=KeyRecordCache(1.0, clock=lambda: now[0]))
    plaintext, record = await store.create("initech")
    meta = ((md.AUTHORIZATION, f"Bearer {plaintext}"),)
    assert (await authenticator.authenticate(meta)).key_id == record.key_id
    assert await store.revoke(record.key_id)
    now[0] = 0.99  # within the documented bound the cached record still answers
    assert (await authenticator.authenticate(meta)).key_id == record.key_id
    now[0] = 1.0
    with pytest.raises(Unauthenticated, match="revoked"):
        await authenticator.authenticate(meta)


async def test_a_key_limited_to_models_may_use_only_those(mesh: Gateways, store: KeyStore) -> None:
    limited, record = await store.create("initech", models=["other-model"])
    assert record.models == ("other-model",)
    assert (await store.get(record.key_id)).models == ("other-model",)  # type: ignore[union-attr]
    meta = ((md.AUTHORIZATION, f"Bearer {limited}"),)
    stub = mesh.stubs[0]
    assert (await stub.ListModels(pb.ListModelsRequest(), metadata=meta)).models == []  # fake-model is not its
    mesh.router.seen.clear()
    for model in ("fake-model", ""):
        request = pb.GenerateRequest(prompt="hi", model=model, sampling=pb.SamplingParams(max_tokens=4))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Complete(request, metadata=meta)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "may use other-model" in (err.value.details() or "")
    chat = stub.Chat(metadata=meta)
    await chat.write(
        pb.ChatRequest(turn=pb.ChatTurn(model="fake-model", messages=[pb.ChatMessage(role="user", content="hi")]))
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await chat.read()
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert [s.method for s in mesh.router.seen if s.method != "Chat"] == []  # refused before the router
    allowed, _ = await store.create("initech", models=["fake-model"])
    listed = await stub.ListModels(pb.ListModelsRequest(), metadata=((md.AUTHORIZATION, f"Bearer {allowed}"),))
    assert [m.id for m in listed.models] == ["fake-model"]
    request = pb.GenerateRequest(prompt="hi", model="fake-model", sampling=pb.SamplingParams(max_tokens=4))
    await stub.Complete(request, metadata=((md.AUTHORIZATION, f"Bearer {allowed}"),))


@pytest.mark.parametrize("source", ["static", "jwt", "jwt_string_claim"])
async def test_static_keys_and_jwts_limited_to_models_may_use_only_those(mesh: Gateways, source: str) -> None:
    """The same limit as a stored key's --models: a static key's `:model|model` part, a JWT's `models` claim."""
    limited = {
        "static": LIMITED_KEY,
        "jwt": token(models=["other-model"]),
        "jwt_string_claim": token(models="other-model third-model"),
    }[source]
    meta = ((md.AUTHORIZATION, f"Bearer {limited}"),)
    stub = mesh.stubs[0]
    assert (await stub.ListModels(pb.ListModelsRequest(), metadata=meta)).models == []  # fake-model is not its
    mesh.router.seen.clear()
    for model in ("fake-model", ""):
        request = pb.GenerateRequest(prompt="hi", model=model, sampling=pb.SamplingParams(max_tokens=4))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Complete(request, metadata=meta)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "may use other-model" in (err.value.details() or "")
    chat = stub.Chat(metadata=meta)
    await chat.write(
        pb.ChatRequest(turn=pb.ChatTurn(model="fake-model", messages=[pb.ChatMessage(role="user", content="hi")]))
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await chat.read()
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Embed(pb.EmbedRequest(model="fake-model", inputs=[pb.EmbedInput(text="hi")]), metadata=meta)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "may use other-model" in (err.value.details() or "")
    assert [s.method for s in mesh.router.seen if s.method != "Chat"] == []  # refused before the router
    # Limited to the served model: it is listed and served.
    allowed = token(models=["fake-model"])
    listed = await stub.ListModels(pb.ListModelsRequest(), metadata=((md.AUTHORIZATION, f"Bearer {allowed}"),))
    assert [m.id for m in listed.models] == ["fake-model"]
    request = pb.GenerateRequest(prompt="hi", model="fake-model", sampling=pb.SamplingParams(max_tokens=4))
    await stub.Complete(request, metadata=((md.AUTHORIZATION, f"Bearer {allowed}"),))


@pytest.mark.parametrize("claim", [[], "", [3], {"a": 1}, 7])
async def test_a_jwt_with_a_malformed_models_claim_is_unauthenticated(mesh: Gateways, claim: object) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await mesh.stubs[0].ListModels(
            pb.ListModelsRequest(), metadata=((md.AUTHORIZATION, f"Bearer {token(models=claim)}"),)
        )
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "'models' claim must be a non-empty list" in (err.value.details() or "")


def test_keys_cli_creates_a_key_limited_to_models(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert keys_main(["--redis-url", redis_url, "create", "--tenant", "acme", "--models", "m1, m2"]) == 0
    capsys.readouterr()
    assert keys_main(["--redis-url", redis_url, "list", "--json"]) == 0
    assert '"models": ["m1", "m2"]' in capsys.readouterr().out
