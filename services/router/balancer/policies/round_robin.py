"""The round-robin replica policy (``routing_policy: round_robin``): the baseline the cache-aware
policy is measured against (benchmarks/router), and the tie-break among equally loaded embedders."""

from __future__ import annotations

from collections.abc import Sequence

from services.common.errors import Unavailable
from services.router.balancer.policies.base import Candidate, ReplicaPolicy, Selection


class RoundRobin(ReplicaPolicy):
    """The candidates in turn, one cursor per group (tier): blind to load and to cached prefixes."""

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def select(self, candidates: Sequence[Candidate], blocks: Sequence[bytes], *, group: str = "") -> Selection:
        if not candidates:
            raise Unavailable("no healthy worker can serve this request right now; retry in a few seconds")
        i = self._next.get(group, 0)
        self._next[group] = i + 1
        chosen = candidates[i % len(candidates)]
        return Selection(chosen.name, self.cached_blocks(chosen.name, blocks, chosen.hot), "round_robin")
