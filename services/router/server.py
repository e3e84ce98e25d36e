"""Build the router's dependencies and start its gRPC server (used by ``__main__`` and tests)."""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
from collections.abc import Callable, Sequence
from functools import partial

import grpc
import structlog

from services.common.errors import ConfigError, InvalidArgument
from services.common.metrics import track_load
from services.common.pb.meshserve.internal.v1 import registry_pb2, registry_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2, inference_pb2_grpc
from services.common.serving import RunningServer, start_server
from services.common.tokenizer import Tokenizer
from services.router.balancer.core import SERVICE, Router
from services.router.balancer.host_hold import HostHold
from services.router.balancer.policies import PolicyOptions, make_policy
from services.router.balancer.registry import Registry, Replica
from services.router.balancer.slo_queue import Admission
from services.router.balancer.stream_transport import StreamTransport
from services.router.balancer.tiers import TierName
from services.router.balancer.wake import IdleSweeper, Waker
from services.router.config import ModelSpec, RouterSettings, VersionSpec
from services.router.frontend import models
from services.router.frontend.admin_servicer import SERVICE_NAME as ADMIN_SERVICE_NAME
from services.router.frontend.admin_servicer import RouterAdminServicer
from services.router.frontend.api import RouterAPI
from services.router.frontend.location import PrefixLocator
from services.router.frontend.registry_servicer import WorkerRegistryServicer
from services.router.frontend.rollout import RollbackRule, Rollout, RolloutPolicy
from services.router.frontend.rollout_sync import RolloutSync
from services.router.frontend.servicer import RouterServicer
from services.store.response_cache import ResponseCache
from services.store.rollouts import RolloutStore

log = structlog.get_logger(__name__)
SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
REGISTRY_SERVICE_NAME = registry_pb2.DESCRIPTOR.services_by_name["WorkerRegistry"].full_name


async def start_router(settings: RouterSettings, tokenizer: Tokenizer | None = None) -> tuple[RunningServer, Router]:
    """Start a router; health is SERVING while at least one worker replica is healthy.

    Returns the running server (``await server.stop()`` also closes the registry and the cache)
    and the :class:`Router` (its ``registry`` and ``cache`` are useful to tests and admin code).
    """
    server, api = await start_router_api(settings, tokenizer)
    return server, api.router


async def start_router_api(
    settings: RouterSettings,
    tokenizer: Tokenizer | None = None,
    *,
    announce: bool = True,
    follow: Sequence[RunningServer] = (),
) -> tuple[RunningServer, RouterAPI]:
    """:func:`start_router`, returning its transport-free API (the gateway's embedded router calls it
    in-process; its ``router`` is the Router). ``announce=False``: the server is the process's second
    one (see start_server).
    ``follow``: other servers of this process whose health is the router's (SERVING while a worker
    replica is healthy): the gateway that carries it.
    """
    specs, default_model, by_model = settings.served_models()
    tokenizers: dict[str, Tokenizer] = {}
    for spec in specs:  # the one passed in (tests) is the default model's
        assert spec.tokenizer_dir is not None
        given = tokenizer if spec.id == default_model else None
        tokenizers[spec.id] = given or Tokenizer(spec.tokenizer_dir)
    cache = ResponseCache.from_url(
        settings.redis_url,
        timeout_s=settings.cache_timeout_s,
        ttl_s=settings.cache_ttl_s,
        max_entry_bytes=settings.cache_max_entry_bytes,
        retry_after_s=settings.cache_retry_after_s,
        service=SERVICE,
    )
    holder: list[RunningServer] = []
    pending: set[asyncio.Task[None]] = set()

    holds_from_zero = False  # set once the versions' idle policies are known

    def serving() -> bool:
        """SERVING while a worker is up (awake or asleep), or while a version may be held for a worker to
        start (min_replicas 0: the local scaler or KEDA starts one on the held-requests gauge)."""
        return bool(registry.healthy_tiers()) or holds_from_zero

    async def apply(running: RunningServer) -> None:  # the state when it runs: a late task sets no stale one
        await running.set_serving(serving())

    def on_change(any_up: bool) -> None:
        log.info("router_workers_available", available=any_up)
        for running in holder:
            task = asyncio.get_running_loop().create_task(apply(running))
            pending.add(task)
            task.add_done_callback(pending.discard)

    selector = make_policy(settings.routing_policy, PolicyOptions(epsilon=settings.balance_epsilon))
    transport = StreamTransport(settings.internal_token)

    def forget(address: str) -> None:  # a replica left: what the router kept for it goes too
        selector.drop(address)
        transport.retire(address)  # its connection ends with its last stream

    registry = Registry(
        settings.edge_workers,
        settings.cloud_workers,
        internal_token=settings.internal_token,
        interval_s=settings.health_interval_s,
        timeout_s=settings.health_timeout_s,
        probe_timeouts_to_down=settings.probe_timeouts_to_down,
        on_change=on_change,
        eject_base_s=settings.eject_base_s,
        eject_max_s=settings.eject_max_s,
        readmit_s=settings.readmit_s,
        heartbeat_ttl_s=settings.heartbeat_ttl_s,
        block_tokens=settings.prefix_block_tokens,
        model_version=settings.model_version(),
        kv_high_watermark=settings.kv_high_watermark,
        drain_s=settings.shutdown_grace_s,
        # A worker's report of its hot prefix blocks replaces the router's memory of what it sent.
        on_report=lambda replica: selector.forget(replica.address),
        max_replicas=settings.max_replicas,
        on_drop=forget,
        model_versions=[v.build_id for spec in specs for v in spec.versions],
    )
    await registry.start()
    host_hold = (
        HostHold(transport.hold_background, lambda: [r.address for r in registry.replicas])
        if settings.hold_background_on_host
        else None
    )

    wakers: list[Waker] = []

    def router_for(spec: ModelSpec, version: VersionSpec) -> Router:
        """One version's Router: its own admission over its own replicas (all of them without a models file)."""
        match = models.serves(spec.id, version.build_id) if by_model else None

        def replicas() -> list[Replica]:
            return [r for r in registry.replicas if match is None or match(r)]

        waker = Waker(
            model=spec.id,
            version=version.name,
            replicas=replicas,
            wake=registry.wake,
            sleep=registry.sleep,
            idle=settings.idle_for(spec, version),
            deadline_s=settings.wake_deadline_s,
            max_held=settings.max_held_per_model,
        )
        registry.listeners.append(waker.notify)
        wakers.append(waker)

        def slots(tier: TierName) -> int:  # a replica out of KV room gives none: new turns wait or spill
            return sum(
                settings.replica_slots or r.max_active
                for r in registry.healthy(tier)
                if not r.kv_full and (match is None or match(r))
            )

        admission = Admission(
            slots,
            default_slo_ms=settings.ttft_slo_ms,
            tenant_slo_ms={t: int(ms) for t, ms in settings.tenant_ttft_slo_ms.items()},
            tenant_weights=settings.tenant_weights,
            turn_s=settings.assumed_turn_s,
        )
        return Router(
            tokenizer=tokenizers[spec.id],
            cache=cache,
            registry=registry,
            model_id=spec.id,
            model_version=version.build_id,
            internal_token=settings.internal_token,
            edge_max_prompt_tokens=settings.edge_max_prompt_tokens,
            retries_before_first_token=settings.retries_before_first_token,
            failovers_after_first_token=settings.failovers_after_first_token,
            admission=admission,
            selector=selector,
            block_tokens=settings.prefix_block_tokens,
            stall_timeout_s=settings.stall_timeout_s,
            resume_same_build_wait_s=settings.resume_same_build_wait_s,
            collapse=settings.collapse_requests,
            tenant_tiers=settings.tenant_tiers,
            transport=transport,
            serves=match,
            host_hold=host_hold,
            waker=waker,
        )

    try:
        table = models.ModelTable(
            [_served(spec, router_for, tokenizers[spec.id], settings) for spec in specs], default_model
        )
    except InvalidArgument as exc:
        await registry.close()
        raise ConfigError(f"models_file {settings.models_file}: {exc.message}") from None
    except ValueError as exc:  # a generation default out of range (a checkpoint's generation_config.json)
        await registry.close()
        raise ConfigError(str(exc)) from None
    for served in table.models.values():
        for v in served.versions.values():
            log.info("router_generation_defaults", model=served.id, version=v.name, **v.defaults.as_dict())
    holds_from_zero = any(w.idle.min_replicas == 0 for w in wakers)
    for w in wakers:
        idle = w.idle
        log.info(
            "router_idle_policy",
            model=w.model,
            version=w.version,
            min_replicas=idle.min_replicas,
            idle_after_s=idle.idle_after_s,
            stop_after_s=idle.stop_after_s,
        )
    sweeper = IdleSweeper(wakers)
    sweeper.start()
    sync = None
    if by_model and settings.redis_url:  # several versions: their policies are shared by the replicas
        store = RolloutStore.from_url(settings.redis_url, timeout_s=settings.rollout_store_timeout_s)
        replica = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        sync = RolloutSync(store, table, poll_s=settings.rollout_poll_s, replica=replica)
        await sync.start()
    routers = table.routers()
    for tier in TierName:
        track_load(
            SERVICE,
            tier.value,
            queued=partial(lambda t: sum(r.admission.waiting(t) for r in routers), tier),
            active=partial(lambda t: sum(r.admission.busy(t) for r in routers), tier),
        )
    default = table.get("")
    router = default.versions[default.rollout.policy.primary].router
    api = RouterAPI(
        router,
        context_length=default.context_length,
        default_max_tokens=settings.default_max_tokens,
        max_queued_chat_turns=settings.max_queued_chat_turns,
        models=table,
        shadow_max_in_flight=settings.shadow_max_in_flight,
        max_embed_tokens=settings.max_embed_tokens,
    )
    servicer = RouterServicer(api, flush=settings.flush_window())
    registration = WorkerRegistryServicer(registry) if settings.accept_registrations else None
    # The replica view for `meshserve status`, prefix locations for `meshserve cache where`.
    locator = PrefixLocator(router, block_tokens=settings.prefix_block_tokens, context_length=settings.context_length)
    admin = RouterAdminServicer(registry, locator, table, sync)

    def register(s: grpc.aio.Server) -> None:
        _register(s, servicer, registration)
        admin.register(s)

    server = await start_server(
        settings,
        register,
        [SERVICE_NAME, ADMIN_SERVICE_NAME, *([REGISTRY_SERVICE_NAME] if registration else [])],
        internal=True,
        serving=serving(),
        announce=announce,
    )
    holder.append(server)
    for running in follow:
        await running.set_serving(serving())
        holder.append(running)

    async def close() -> None:
        await sweeper.close()
        for shadow in list(api.shadows):
            shadow.cancel()
        if sync is not None:
            await sync.close()
        for each in routers:
            await each.collapser.aclose()
        if host_hold is not None:
            await host_hold.close()
        await transport.close()
        await registry.close()
        await cache.close()

    server.on_stop.append(close)
    return server, api


def _served(
    spec: ModelSpec,
    router_for: Callable[[ModelSpec, VersionSpec], Router],
    tokenizer: Tokenizer,
    settings: RouterSettings,
) -> models.ServedModel:
    versions = {
        v.name: models.ServedVersion(v.name, v.build_id, router_for(spec, v), settings.generation_defaults_for(spec, v))
        for v in spec.versions
    }
    names = list(versions)
    r = spec.rollout
    rule = None
    if r.rollback is not None:
        rule = RollbackRule(
            error_rate_margin=r.rollback.error_rate_margin,
            ttft_p99_margin_s=r.rollback.ttft_p99_margin_ms / 1000,
            window_s=r.rollback.window_s,
            min_samples=r.rollback.min_samples,
        )
    policy = RolloutPolicy(r.weights or {names[0]: 100}, sticky=r.sticky, shadow=r.shadow, rollback=rule)
    rollout = Rollout(spec.id, names, policy, on_rollback=models.log_rollback)
    assert spec.context_length is not None
    return models.ServedModel(spec.id, spec.context_length, tokenizer, versions, rollout)


def _register(server: grpc.aio.Server, inference: RouterServicer, registry: WorkerRegistryServicer | None) -> None:
    inference_pb2_grpc.add_InferenceServicer_to_server(inference, server)
    if registry is not None:
        registry_pb2_grpc.add_WorkerRegistryServicer_to_server(registry, server)
