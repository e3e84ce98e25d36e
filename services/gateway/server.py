"""The gateway process wired up: what ``python -m services.gateway`` runs."""

from __future__ import annotations

import grpc
import structlog

from services.common.config import load_settings
from services.common.errors import ConfigError
from services.common.pb.meshserve.v1 import batch_pb2_grpc, inference_pb2_grpc
from services.common.serving import MAX_MESSAGE_BYTES, RunningServer, start_server
from services.gateway.admission import Gate
from services.gateway.auth import ApiKeyAuthenticator, parse_api_keys
from services.gateway.batches import SERVICE_NAME as BATCHES_SERVICE_NAME
from services.gateway.batches import BatchesServicer
from services.gateway.config import GatewaySettings
from services.gateway.decoding import GuardedServer
from services.gateway.identity import Authenticator
from services.gateway.jwt_auth import JwtVerifier
from services.gateway.keycache import KeyRecordCache
from services.gateway.keystore import KeyStore
from services.gateway.ratelimit import RateLimiter
from services.gateway.remote_router import RemoteRouter
from services.gateway.servicer import SERVICE_NAME, GatewayServicer
from services.router.config import RouterSettings
from services.store.batches import BatchStore
from services.store.connection import AnyRedis, redis_from_url
from services.store.pipelined import PipelinedRedis, supports

log = structlog.get_logger(__name__)


def redis_client(url: str, timeout_s: float, max_connections: int = 128) -> AnyRedis:
    """A Redis client for ``url`` (one server, ``redis+sentinel://`` or ``redis+cluster://``; see
    services/store/connection.py) with short timeouts, no retries (an outage must cost one timeout) and a
    bounded pool: a call that finds ``max_connections`` calls in flight fails at once, like an unreachable
    Redis (the limiter's failure mode applies). Not a blocking pool: waiting for a free connection
    costs every admission ~20 µs more (a condition and a timer per call), on the path to the first token.
    """
    return redis_from_url(
        url,
        timeout_s,
        read_timeout_s=timeout_s,
        max_connections=max_connections,
        client_name="meshserve-gateway",  # who is who in CLIENT LIST
    )


def build_gate(settings: GatewaySettings) -> Gate:
    """Credential sources, tenant policies and the limiter, from the settings."""
    keys = parse_api_keys(settings.api_keys)
    jwt = JwtVerifier.from_files(
        jwks_file=settings.jwt_jwks_file,
        hs256_secret=settings.jwt_hs256_secret,
        audience=settings.jwt_audience,
        issuer=settings.jwt_issuer,
        tenant_claim=settings.jwt_tenant_claim,
        models_claim=settings.jwt_models_claim,
        leeway_s=settings.jwt_leeway_s,
    )
    store, limiter, state_client = None, None, None
    if settings.state_redis_url and settings.state_redis_url != settings.redis_url:  # keys in the state Redis
        state_client = redis_client(settings.state_redis_url, settings.redis_timeout_s, settings.redis_max_connections)
        store = KeyStore(state_client)
    if settings.redis_url:
        # one pool, closed by the limiter
        client = redis_client(settings.redis_url, settings.redis_timeout_s, settings.redis_max_connections)
        store = store or KeyStore(client)
        pipelined = None
        if settings.redis_pipelined and supports(settings.redis_url):
            pipelined = PipelinedRedis(
                settings.redis_url, timeout_s=settings.redis_timeout_s, client_name="meshserve-gateway-limiter"
            )
        limiter = RateLimiter(
            client,
            failure_mode=settings.rate_limit_failure_mode,
            retry_after_s=settings.rate_limit_retry_s,
            pipelined=pipelined,
        )
    cache = KeyRecordCache(settings.key_cache_ttl_s) if store is not None and settings.key_cache_ttl_s > 0 else None
    authenticator = Authenticator(ApiKeyAuthenticator(keys), store, jwt, cache)
    if not authenticator.configured:
        raise ConfigError(
            "no credentials configured: set MESHSERVE_GATEWAY_API_KEYS (tenant:sha256hex entries), "
            "MESHSERVE_GATEWAY_REDIS_URL (keys from `meshserve keys create`) or a JWT secret/JWKS file"
        )
    if limiter is None:
        log.warning("rate_limits_disabled", reason="MESHSERVE_GATEWAY_REDIS_URL is not set")
    gate = Gate(
        authenticator,
        settings.policy_book(),
        limiter,
        refused_serial_s=settings.refused_serial_s,
        speculative_starts=settings.speculative_starts,
    )
    if state_client is not None:
        gate.on_close.append(state_client.aclose)
    return gate


async def serve(settings: GatewaySettings) -> RunningServer:
    """Start the gateway (health SERVING once bound) and return it; ``stop()`` also closes the router channel."""
    running, _gate = await start_gateway(settings)
    return running


async def start_gateway(
    settings: GatewaySettings, router_settings: RouterSettings | None = None
) -> tuple[RunningServer, Gate]:
    """:func:`serve`, also returning the admission gate (tests wait on its settlements).

    With ``settings.embed_router`` the router runs in this process (``router_settings``, else
    MESHSERVE_ROUTER_*): its server starts after the gateway's, and the gateway's health is then the
    router's: SERVING while a worker replica is healthy (registered, or configured and answering its
    probes), so a load balancer sends no calls to a gateway that could only refuse them (one restarted
    before its workers' next heartbeats, say).
    """
    gate = build_gate(settings)
    channel = None
    remote: RemoteRouter | None = None
    if not settings.embed_router:
        channel = grpc.aio.insecure_channel(
            settings.router_address,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ],
        )
        remote = RemoteRouter(inference_pb2_grpc.InferenceStub(channel), settings.internal_token)
    servicer = GatewayServicer(settings, gate, remote)  # embedded: the router is set once it has started
    # Files and batches (durable state): their own pool, with time for a file's bytes (the limiter's
    # calls have 0.25 s).
    batch_redis = redis_from_url(settings.state_url, 5.0, read_timeout_s=10.0) if settings.state_url else None
    batches = BatchesServicer(settings, gate, BatchStore(batch_redis) if batch_redis is not None else None)

    def register(server: grpc.aio.Server) -> None:
        inference_pb2_grpc.add_InferenceServicer_to_server(servicer, GuardedServer(server))  # type: ignore[arg-type]
        batch_pb2_grpc.add_BatchesServicer_to_server(batches, GuardedServer(server))  # type: ignore[arg-type]

    try:
        running = await start_server(
            settings,
            register=register,
            service_names=[SERVICE_NAME, BATCHES_SERVICE_NAME],
            serving=not settings.embed_router,
        )
    except BaseException:
        if channel is not None:
            await channel.close()
        if batch_redis is not None:
            await batch_redis.aclose()
        await gate.close()
        raise
    if batch_redis is not None:
        running.on_stop.append(batch_redis.aclose)
    where = settings.router_address
    if channel is not None:
        running.on_stop.append(channel.close)
    if settings.embed_router:
        try:
            router_server = await _start_embedded_router(servicer, router_settings, running)
        except BaseException:
            await running.stop()
            await gate.close()
            raise
        running.on_stop.append(router_server.stop)  # after the gateway has drained its streams
        where = f"embedded (internal port {router_server.port})"
    running.on_stop.append(gate.close)
    log.info(
        "gateway_ready",
        router=where,
        redis=bool(settings.redis_url),
        state_redis="shared" if settings.state_url == settings.redis_url else bool(settings.state_url),
    )
    return running, gate


async def _start_embedded_router(
    servicer: GatewayServicer, settings: RouterSettings | None, gateway: RunningServer
) -> RunningServer:
    """Start the router in this process (its own internal server: workers register and heartbeat there,
    ``meshserve status`` reads its replicas) and give the gateway its API, called in place."""
    from services.router.server import start_router_api  # the router's code loads only when embedded

    try:
        settings = settings or load_settings(RouterSettings)
        server, api = await start_router_api(settings, announce=False, follow=[gateway])
    except ConfigError as exc:  # the router is on by default: say how to call one elsewhere instead
        raise ConfigError(
            f"the router in the gateway's process (MESHSERVE_GATEWAY_EMBED_ROUTER, the default): {exc}; "
            "to call a router of its own instead, set MESHSERVE_GATEWAY_ROUTER_ADDRESS"
        ) from None
    servicer.router = api
    return server


async def run(settings: GatewaySettings) -> None:
    running = await serve(settings)
    await running.serve_until_signal()
