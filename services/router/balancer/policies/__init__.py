"""Replica policies: which replica of the chosen tier serves a request, behind one interface
(:class:`~services.router.balancer.policies.base.ReplicaPolicy`), chosen by name from one table.

``routing_policy`` in the router's settings names one of ``POLICIES``. A new policy is one module
here and one line in the table.
"""

from __future__ import annotations

from services.common.errors import ConfigError
from services.router.balancer.policies.base import PolicyOptions, ReplicaPolicy
from services.router.balancer.policies.cache_aware import CacheAware
from services.router.balancer.policies.round_robin import RoundRobin

POLICIES: dict[str, type[ReplicaPolicy]] = {
    "cache_aware": CacheAware,
    "round_robin": RoundRobin,
}


def make_policy(name: str, options: PolicyOptions | None = None) -> ReplicaPolicy:
    """The policy ``name`` (a key of ``POLICIES``) built from ``options``; ConfigError if unknown."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ConfigError(f"routing_policy {name!r} is unknown; choose one of {', '.join(sorted(POLICIES))}")
    return cls.from_options(options or PolicyOptions())
