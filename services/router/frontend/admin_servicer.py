"""meshserve.internal.v1.RouterAdmin as served by the router: its replica view (`meshserve status`),
where a prompt's KV prefix is (`meshserve cache where`, answered by services/router/frontend/location.py), and
each served model's rollout (`meshserve models rollout`; the domain is services/router/frontend/rollout.py;
with a shared store, services/router/frontend/rollout_sync.py, a change is written there and reaches every
router replica)."""

from __future__ import annotations

import time

import grpc
import structlog

from services.common.errors import InvalidArgument, Unavailable
from services.common.pb.meshserve.internal.v1 import router_admin_pb2, router_admin_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2
from services.router.balancer.registry import Registry
from services.router.balancer.tiers import TierName
from services.router.frontend.location import PrefixLocator, RedisAnswer
from services.router.frontend.models import ModelTable, ServedModel
from services.router.frontend.rollout import RollbackRule, RolloutPolicy
from services.router.frontend.rollout_sync import RolloutSync

log = structlog.get_logger(__name__)
SERVICE_NAME = router_admin_pb2.DESCRIPTOR.services_by_name["RouterAdmin"].full_name
_TIERS = {TierName.EDGE: inference_pb2.TIER_EDGE, TierName.CLOUD: inference_pb2.TIER_CLOUD}
_ASKED = {
    inference_pb2.TIER_UNSPECIFIED: None,
    inference_pb2.TIER_AUTO: None,
    inference_pb2.TIER_EDGE: TierName.EDGE,
    inference_pb2.TIER_CLOUD: TierName.CLOUD,
}
_REDIS = {
    RedisAnswer.ANSWERED: router_admin_pb2.REDIS_LOOKUP_ANSWERED,
    RedisAnswer.UNAVAILABLE: router_admin_pb2.REDIS_LOOKUP_UNAVAILABLE,
    RedisAnswer.DISABLED: router_admin_pb2.REDIS_LOOKUP_DISABLED,
}


class RouterAdminServicer(router_admin_pb2_grpc.RouterAdminServicer):
    """The internal ``RouterAdmin`` service: lists the registry's replicas, locates prompt prefixes."""

    def __init__(
        self, registry: Registry, locator: PrefixLocator, models: ModelTable, sync: RolloutSync | None = None
    ) -> None:
        self._registry = registry
        self._locator = locator
        self._models = models
        self._sync = sync

    def register(self, server: grpc.aio.Server) -> None:
        router_admin_pb2_grpc.add_RouterAdminServicer_to_server(self, server)

    async def ListReplicas(
        self, request: router_admin_pb2.ListReplicasRequest, context: grpc.aio.ServicerContext
    ) -> router_admin_pb2.ListReplicasResponse:
        now = time.monotonic()
        return router_admin_pb2.ListReplicasResponse(
            replicas=[
                router_admin_pb2.ReplicaStatus(
                    address=r.address,
                    worker_id=r.worker_id,
                    tier=_TIERS[r.tier],
                    healthy=r.healthy,
                    active_sequences=r.active_sequences,
                    queue_depth=r.queue_depth,
                    max_active_sequences=r.max_active,
                    in_flight=max(0, r.in_flight),
                    background_in_flight=max(0, r.background_in_flight),
                    load=max(0, r.load),
                    ejections=r.ejections,
                    self_registered=r.registered_until > 0,
                    recent_tokens_per_second=r.report.tokens_per_s,
                    kv_tokens=r.report.kv_tokens,
                    kv_used_bytes=r.report.kv_used_bytes,
                    kv_budget_bytes=r.report.kv_budget_bytes,
                    held_sequences=r.report.held_sequences,
                    hot_prefix_blocks=len(r.hot_blocks),
                    kv_full=r.kv_full,
                    report_age_ms=int((now - r.reported_at) * 1000) if r.reported_at else 0,
                )
                for r in self._registry.replicas
            ]
        )

    async def PrefixLocation(
        self, request: router_admin_pb2.PrefixLocationRequest, context: grpc.aio.ServicerContext
    ) -> router_admin_pb2.PrefixLocationResponse:
        if request.tier not in _ASKED:
            raise InvalidArgument(f"unknown tier {request.tier}; use TIER_AUTO, TIER_EDGE or TIER_CLOUD")
        model = self._models.get(request.model)
        version = model.version(request.version)
        locator = self._locator.scoped(version.router, model.context_length)
        where = await locator.locate(
            text=request.text,
            messages=[{"role": m.role, "content": m.content} for m in request.messages],
            tenant=request.tenant,
            shareable=request.shareable_prefix,
            tier=_ASKED[request.tier],
        )
        return router_admin_pb2.PrefixLocationResponse(
            prompt_tokens=where.prompt_tokens,
            block_tokens=where.block_tokens,
            prompt_blocks=where.prompt_blocks,
            tier=_TIERS[where.tier.tier],
            tier_reason=where.tier.reason,
            replicas=[
                router_admin_pb2.PrefixHolder(address=h.address, worker_id=h.worker_id, cached_blocks=h.cached_blocks)
                for h in where.holders
            ],
            redis=_REDIS[where.redis],
            redis_blocks=where.redis_blocks,
            redis_checked_blocks=where.redis_checked_blocks,
            redis_block_tokens=where.redis_block_tokens,
            model_id=where.model_id,
            model_version=where.model_version,
            version=version.name,
        )

    async def ListRollouts(
        self, request: router_admin_pb2.ListRolloutsRequest, context: grpc.aio.ServicerContext
    ) -> router_admin_pb2.ListRolloutsResponse:
        chosen = [self._models.get(request.model)] if request.model else list(self._models.models.values())
        return router_admin_pb2.ListRolloutsResponse(models=[self._status(m) for m in chosen])

    async def SetRollout(
        self, request: router_admin_pb2.SetRolloutRequest, context: grpc.aio.ServicerContext
    ) -> router_admin_pb2.ModelRollout:
        model = self._model(request.model)
        if self._sync is not None:  # the fields not given keep the shared policy's, not a stale copy's
            try:
                await self._sync.refresh([model.id])
            except Unavailable:
                pass  # publish below says so
        old = model.rollout.policy
        weights = {w.version: w.weight for w in request.weights} if request.weights else dict(old.weights)
        if len(weights) != len(request.weights) and request.weights:
            raise InvalidArgument("weights name a version twice; give each version once")
        rule = old.rollback
        if request.clear_rollback:
            rule = None
        elif request.HasField("rollback"):
            r = request.rollback
            rule = RollbackRule(
                error_rate_margin=r.error_rate_margin,
                ttft_p99_margin_s=r.ttft_p99_margin_ms / 1000,
                window_s=r.window_s or 60.0,
                min_samples=r.min_samples or 50,
            )
        sticky = request.sticky if request.HasField("sticky") else old.sticky
        shadow = (request.shadow or None) if request.HasField("shadow") else old.shadow
        # The primary follows the weights: the heaviest version (a promoted canary becomes it).
        new = RolloutPolicy(weights, sticky=sticky, shadow=shadow, rollback=rule)  # type: ignore[arg-type]
        if self._sync is not None:
            await self._sync.publish(model, new)  # logs rollout_changed with its epoch
            return self._status(model)
        model.rollout.set_policy(new)
        log.info(
            "rollout_changed",
            model=model.id,
            weights=dict(new.weights),
            sticky=new.sticky,
            shadow=new.shadow or "",
            primary=new.primary,
            rollback=rule is not None,
        )
        return self._status(model)

    async def Rollback(
        self, request: router_admin_pb2.RollbackRequest, context: grpc.aio.ServicerContext
    ) -> router_admin_pb2.ModelRollout:
        model = self._model(request.model)
        model.rollout.rollback("manual")  # here at once, whatever Redis does
        if self._sync is not None:
            try:
                await self._sync.flush()
            except Unavailable as exc:  # written when Redis is back (the status says it is pending)
                log.warning("rollout_rollback_not_shared_yet", model=model.id, error=exc.message)
        return self._status(model)

    def _model(self, name: str) -> ServedModel:
        if not name:
            raise InvalidArgument("model is empty; name the model whose rollout to change (ListRollouts lists them)")
        return self._models.get(name)

    def _status(self, model: ServedModel) -> router_admin_pb2.ModelRollout:
        rollout = model.rollout
        policy = rollout.policy
        now = time.monotonic()
        versions = []
        for name, served in model.versions.items():
            counters = rollout.counters[name]
            samples, error_rate, p99 = rollout.window(name)
            versions.append(
                router_admin_pb2.VersionStatus(
                    version=name,
                    build=served.build,
                    healthy_replicas=sum(len(served.router.healthy(t)) for t in TierName),
                    requests=counters.requests,
                    errors=counters.errors,
                    window_samples=samples,
                    window_error_rate=error_rate,
                    window_ttft_p99_ms=(p99 or 0.0) * 1000,
                    shadow_requests=counters.shadow_requests,
                    shadow_compared=counters.shadow_compared,
                    shadow_agreed=counters.shadow_agreed,
                    shadow_shed=counters.shadow_shed,
                )
            )
        rule = policy.rollback
        return router_admin_pb2.ModelRollout(
            model=model.id,
            is_default=model.id == self._models.default,
            weights=[router_admin_pb2.VersionWeight(version=v, weight=w) for v, w in policy.weights.items()],
            sticky=policy.sticky,
            shadow=policy.shadow or "",
            primary=policy.primary,
            rollback=None
            if rule is None
            else router_admin_pb2.RollbackRule(
                error_rate_margin=rule.error_rate_margin,
                ttft_p99_margin_ms=rule.ttft_p99_margin_s * 1000,
                window_s=rule.window_s,
                min_samples=rule.min_samples,
            ),
            versions=versions,
            rollbacks=[
                router_admin_pb2.RollbackEventStatus(version=e.version, to=e.to, reason=e.reason, age_s=now - e.at)
                for e in rollout.rollbacks
            ],
            policy_epoch=self._sync.epochs.get(model.id, 0) if self._sync is not None else 0,
            policy_store=self._store_state(model.id),
        )

    def _store_state(self, model: str) -> str:
        if self._sync is None:
            return "local"
        if self._sync.pending(model):
            return "pending"
        return "shared" if self._sync.reachable else "unreachable"
