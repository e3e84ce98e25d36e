"""The models a router serves: per model id its tokenizer, context length, versions and rollout.

Each version of a model has its own :class:`~services.router.balancer.core.Router` (its answer keys, prefix
hashes and collapsing keyed by model id and build, its admission over its own replicas: the
registry's replicas that report that model id and build), so the response and KV caches never mix
models or versions. :class:`ModelTable` resolves a request's ``model`` (empty: the default one) to
its :class:`ServedModel`; the model's :class:`~services.router.frontend.rollout.Rollout` picks the version.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from services.common.errors import NotFound
from services.common.generation_defaults import NO_DEFAULTS, GenerationDefaults
from services.common.tokenizer import Tokenizer
from services.router.balancer.core import Router
from services.router.balancer.registry import Replica
from services.router.balancer.tiers import TierName
from services.router.balancer.wake import version_state
from services.router.frontend.rollout import RollbackEvent, Rollout, RolloutPolicy
from services.router.metrics import ROLLBACKS

log = structlog.get_logger(__name__)


@dataclass
class ServedVersion:
    """One version (build) of a model and the router that runs it on that build's replicas."""

    name: str
    build: str
    router: Router
    defaults: GenerationDefaults = NO_DEFAULTS
    """Its generation defaults, every layer merged (services/common/generation_defaults.py): what a
    request leaving a sampling field unset gets on this version."""
    metrics: dict[tuple[str, ...], Any] = field(default_factory=dict)
    """Its labelled metric children, looked up once (``labels()`` costs more than the rest of the count)."""


@dataclass
class ServedModel:
    """One model id: what tokenizes for it, its context, its versions and their rollout."""

    id: str
    context_length: int
    tokenizer: Tokenizer
    versions: dict[str, ServedVersion]
    rollout: Rollout

    def tiers(self) -> set[TierName]:
        """Tiers with replicas of any of its versions configured (healthy or not)."""
        return {t for v in self.versions.values() for t in v.router.tiers()}

    def choose(self, tenant: str) -> ServedVersion:
        return self.versions[self.rollout.choose(tenant)]

    def state(self) -> str:
        """Its primary version's model state for ListModels: awake, waking, asleep or stopped."""
        return version_state(self.versions[self.rollout.policy.primary].router.replicas())

    @property
    def defaults(self) -> GenerationDefaults:
        """The primary version's generation defaults (ListModels shows them)."""
        return self.versions[self.rollout.policy.primary].defaults

    def version(self, name: str) -> ServedVersion:
        """The version named ``name`` (empty: the primary); NotFound names this model's versions."""
        found = self.versions.get(name or self.rollout.policy.primary)
        if found is None:
            known = ", ".join(self.versions)
            raise NotFound(f"model {self.id!r} has no version {name[:64]!r}; its versions are {known}")
        return found


class ModelTable:
    """Every served model by id; ``default`` serves requests that name none."""

    def __init__(self, models: Sequence[ServedModel], default: str) -> None:
        self.models = {m.id: m for m in models}
        self.default = default
        assert default in self.models

    @classmethod
    def single(cls, router: Router, context_length: int, defaults: GenerationDefaults = NO_DEFAULTS) -> ModelTable:
        """One model, one version: the router that runs every replica (the layout without a models file)."""
        version = router.model_version or "default"
        rollout = Rollout(router.model_id, [version], RolloutPolicy({version: 100}), on_rollback=log_rollback)
        served = ServedVersion(version, router.model_version, router, defaults)
        model = ServedModel(router.model_id, context_length, router.tokenizer, {version: served}, rollout)
        return cls([model], router.model_id)

    def get(self, model: str) -> ServedModel:
        """The model named ``model`` (empty: the default one); NotFound names the served ones."""
        found = self.models.get(model or self.default)
        if found is None:
            served = ", ".join(self.models)
            # The name is echoed cut short: a long one would not fit in a status message.
            raise NotFound(f"unknown model {model[:64]!r}; ListModels shows the served models ({served})")
        return found

    def routers(self) -> list[Router]:
        return [v.router for m in self.models.values() for v in m.versions.values()]


def serves(model_id: str, build: str) -> Callable[[Replica], bool]:
    """The replica filter of one version: replicas whose latest report names this model id and build."""

    def match(replica: Replica) -> bool:
        return replica.report.model_id == model_id and replica.report.model_version == build

    return match


def log_rollback(event: RollbackEvent) -> None:
    """The rollback's log line and counter (``reason`` "manual" or why it was automatic)."""
    trigger = "manual" if event.reason == "manual" else "auto"
    ROLLBACKS.labels(event.model, event.version, trigger).inc()
    log.warning(
        "rollout_rolled_back",
        model=event.model,
        version=event.version,
        to=event.to,
        trigger=trigger,
        reason=event.reason,
    )
