"""The one interface every replica policy implements, and what it sees and answers.

The router hands a policy the healthy replicas of the chosen tier (:class:`Candidate`: name, load,
the prefix blocks it reported hot, whether its KV budget is full) and the prompt's prefix blocks
(services/router/balancer/blocks.py), and gets back one :class:`Selection`. A policy may remember
where it sent what (:meth:`ReplicaPolicy.record` happens inside :meth:`~ReplicaPolicy.select`); the
router tells it when that memory is stale (:meth:`~ReplicaPolicy.forget`: a new load report or a
lost cache) and when a replica has left (:meth:`~ReplicaPolicy.drop`). Pure state, no grpc, no I/O.

A new policy is one module in this package and one line in ``POLICIES``
(services/router/balancer/policies/__init__.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Self


@dataclass(frozen=True)
class Candidate:
    """A replica as the policy sees it."""

    name: str
    load: int
    hot: Collection[bytes] = frozenset()
    """Prefix block hashes the replica reported holding KV for (a set, for fast membership)."""
    kv_full: bool = False
    """Its KV budget is used up: chosen only when every candidate is."""


@dataclass(frozen=True)
class Selection:
    """The chosen replica, how many prompt blocks it is believed to hold, and why it was chosen."""

    name: str
    cached_blocks: int
    reason: str
    """The ``meshserve_router_replica_decisions_total`` label: "prefix" (longest cached prefix), "ring"
    (consistent hash), "p2c", "only", "kv_room" (cache_aware), "round_robin"."""


@dataclass(frozen=True)
class PolicyOptions:
    """The router's settings a policy may use (``RouterSettings``; each policy takes what it needs)."""

    epsilon: float = 0.25
    """``balance_epsilon``: how far above the average load bounded-load placement lets a replica go."""


class ReplicaPolicy(ABC):
    """Chooses one replica of a tier for a request (module docstring)."""

    @classmethod
    def from_options(cls, options: PolicyOptions) -> Self:
        """The policy built from the router's settings (default: it takes none)."""
        return cls()

    @abstractmethod
    def select(self, candidates: Sequence[Candidate], blocks: Sequence[bytes], *, group: str = "") -> Selection:
        """Choose among ``candidates`` (raises Unavailable when empty) for a prompt whose prefix block
        hashes are ``blocks``; ``group`` names the candidates' set (the tier) for policies that keep
        state per set."""

    def cached_blocks(self, name: str, blocks: Sequence[bytes], hot: Collection[bytes] = ()) -> int:
        """Leading blocks of ``blocks`` that replica ``name`` is believed to hold: by default those it
        reported ``hot``; a policy that remembers where it sent prompts adds those."""
        n = 0
        for b in blocks:
            if b not in hot:
                break
            n += 1
        return n

    def forget(self, name: str) -> None:  # noqa: B027 - optional hook, no state by default
        """Replica ``name`` lost its cache (restarted or ejected), or reported where its KV is."""

    def drop(self, name: str) -> None:  # noqa: B027 - optional hook, no state by default
        """Replica ``name`` left the registry: nothing is kept for it."""
