"""Versions of one model and their rollout: which version serves a request, and when a canary goes back.

A served model id resolves to one or more *versions* (build ids: the ``model_version`` its workers
report). Its :class:`RolloutPolicy` says how requests spread over them:

* ``weights``: version -> integer weight (a canary: ``{"v1": 95, "v2": 5}``); versions with weight 0
  get no traffic (they may still be the shadow).
* ``sticky``: ``"chat"`` (the default): a chat keeps the version its first turn drew (the caller
  resolves once per session) and each Generate draws anew; ``"tenant"``: a tenant's requests and
  chats all land on one version, chosen by a hash of the tenant (a weight change moves only the
  tenants whose hash crosses the new boundary).
* ``shadow``: a version that gets a copy of each Generate once the primary's answer is done; its
  output is discarded, its latency and agreement with the primary are recorded.
* ``rollback``: a :class:`RollbackRule`: a canary (any version with weight other than the primary)
  whose error rate or TTFT p99 over ``window_s`` exceeds the primary's by the margin is rolled back
  (all weight to the primary) automatically.

:class:`Rollout` holds a model's current policy (replaced whole at run time: requests in flight keep
the version they drew, new ones see the new policy), its per-version samples and its counters. Pure
domain code: no transport, no clock or randomness it is not given.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from services.common.errors import InvalidArgument

Sticky = Literal["chat", "tenant"]
STICKY: tuple[Sticky, ...] = ("chat", "tenant")
MAX_SAMPLES = 1024
"""Samples kept per version for the rollback decision (the oldest go first; the window prunes too)."""
SERVER_FAULTS = frozenset({"UNAVAILABLE", "INTERNAL", "UNKNOWN", "DEADLINE_EXCEEDED", "DATA_LOSS"})
"""Status codes that count as a version's error (a refusal of the caller's own request does not)."""


@dataclass(frozen=True)
class RollbackRule:
    """When a canary is rolled back automatically (compared with the primary over the same window)."""

    error_rate_margin: float = 0.05
    """Roll back when the canary's error rate exceeds the primary's by more than this (0.05 = 5 points)."""
    ttft_p99_margin_s: float = 0.5
    """Roll back when the canary's TTFT p99 exceeds the primary's by more than this many seconds."""
    window_s: float = 60.0
    """Samples older than this are not counted."""
    min_samples: int = 50
    """Neither side is judged on fewer samples than this in the window."""

    def __post_init__(self) -> None:
        if self.error_rate_margin < 0 or self.ttft_p99_margin_s < 0:
            raise InvalidArgument(
                "rollback.error_rate_margin and rollback.ttft_p99_margin must be 0 or more; e.g. 0.05 and 500 ms"
            )
        if self.window_s <= 0 or self.min_samples < 1:
            raise InvalidArgument("rollback.window_s must be above 0 and rollback.min_samples at least 1")


@dataclass(frozen=True)
class RolloutPolicy:
    """How a model's requests spread over its versions (see the module docstring)."""

    weights: Mapping[str, int]
    sticky: Sticky = "chat"
    shadow: str | None = None
    rollback: RollbackRule | None = None
    primary: str = ""
    """The version a rollback returns to; default the one with the most weight (the first on a tie)."""

    def __post_init__(self) -> None:
        if not self.primary and self.weights:
            object.__setattr__(self, "primary", max(self.weights, key=lambda v: self.weights[v]))

    def check(self, versions: Sequence[str], model: str) -> RolloutPolicy:
        """``self`` if it names only ``versions`` of ``model`` and sends traffic somewhere; else
        InvalidArgument whose message starts with the field at fault (``weights``, ``sticky``, ...)."""
        known = ", ".join(versions)
        for name, weight in self.weights.items():
            if name not in versions:
                raise InvalidArgument(f"weights: model {model!r} has no version {name!r}; its versions are {known}")
            if weight < 0 or weight != int(weight):
                raise InvalidArgument(f"weights: version {name!r} needs a whole number >= 0, not {weight}")
        if sum(self.weights.values()) <= 0:
            raise InvalidArgument(f"weights: those of model {model!r} add up to 0; give at least one version weight")
        if self.sticky not in STICKY:
            raise InvalidArgument(f"sticky must be one of {', '.join(STICKY)}, not {self.sticky!r}")
        if self.shadow is not None and self.shadow not in versions:
            raise InvalidArgument(
                f"shadow: model {model!r} has no version {self.shadow!r} to shadow; its versions are {known}"
            )
        if self.primary not in self.weights or self.weights[self.primary] <= 0:
            raise InvalidArgument(
                f"primary: version {self.primary!r} of model {model!r} needs a weight above 0 (the heaviest is it)"
            )
        return self

    def canaries(self) -> list[str]:
        return [v for v, w in self.weights.items() if w > 0 and v != self.primary]


def tenant_point(model: str, tenant: str) -> float:
    """The tenant's fixed point in [0, 1) for ``model`` (stable across processes and restarts)."""
    digest = hashlib.blake2b(f"{model}\0{tenant}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def pick(policy: RolloutPolicy, point: float) -> str:
    """The version at ``point`` in [0, 1) of the cumulative weights (in the policy's order)."""
    total = sum(policy.weights.values())
    target = point * total
    acc = 0
    chosen = policy.primary
    for version, weight in policy.weights.items():
        if weight <= 0:
            continue
        acc += weight
        chosen = version
        if target < acc:
            return version
    return chosen


@dataclass
class _Samples:
    """One version's recent outcomes: (time, failed, ttft seconds or None)."""

    items: deque[tuple[float, bool, float | None]] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))

    def prune(self, since: float) -> None:
        while self.items and self.items[0][0] < since:
            self.items.popleft()

    def error_rate(self) -> float:
        return sum(1 for _, failed, _ in self.items if failed) / len(self.items) if self.items else 0.0

    def ttft_p99(self) -> float | None:
        ttfts = sorted(t for _, failed, t in self.items if not failed and t is not None)
        if not ttfts:
            return None
        return ttfts[min(len(ttfts) - 1, math.ceil(0.99 * len(ttfts)) - 1)]


@dataclass
class VersionCounters:
    """What a version has served since the router started (for status and tests)."""

    requests: int = 0
    errors: int = 0
    shadow_requests: int = 0
    shadow_agreed: int = 0
    shadow_compared: int = 0
    shadow_shed: int = 0


@dataclass(frozen=True)
class RollbackEvent:
    """An automatic (or manual) rollback: what went back, from which version, why."""

    model: str
    version: str
    to: str
    reason: str
    at: float


class Rollout:
    """A model's versions, its current :class:`RolloutPolicy`, its samples and counters."""

    def __init__(
        self,
        model: str,
        versions: Sequence[str],
        policy: RolloutPolicy,
        *,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_rollback: Callable[[RollbackEvent], object] | None = None,
    ) -> None:
        if not versions:
            raise InvalidArgument(f"model {model!r} needs at least one version")
        self.model = model
        self.versions = tuple(versions)
        self.policy = policy.check(self.versions, model)
        self._rng = rng or random.Random()
        self._clock = clock
        self._listeners: list[Callable[[RollbackEvent], object]] = [on_rollback] if on_rollback else []
        self._samples = {v: _Samples() for v in self.versions}
        self.counters = {v: VersionCounters() for v in self.versions}
        self.rollbacks: list[RollbackEvent] = []

    def choose(self, tenant: str = "") -> str:
        """The version for a new request or chat (a chat keeps it for all its turns)."""
        policy = self.policy
        if len(policy.weights) == 1:  # one version (every model without a canary): nothing to draw
            return policy.primary
        point = tenant_point(self.model, tenant) if policy.sticky == "tenant" else self._rng.random()
        return pick(policy, point)

    def set_policy(self, policy: RolloutPolicy) -> RolloutPolicy:
        """Replace the policy (checked first: a bad one changes nothing); new samples start clean."""
        self.policy = policy.check(self.versions, self.model)
        for samples in self._samples.values():
            samples.items.clear()
        return self.policy

    def rollback(self, reason: str = "manual") -> RolloutPolicy:
        """All weight back to the primary, no shadow; the event is kept (and reported to ``on_rollback``)."""
        old = self.policy
        canaries = old.canaries() or [v for v in self.versions if v != old.primary][:1]
        weights = {v: (100 if v == old.primary else 0) for v in old.weights}
        self.policy = replace(old, weights=weights, shadow=None)
        for samples in self._samples.values():
            samples.items.clear()
        for canary in canaries:
            event = RollbackEvent(self.model, canary, old.primary, reason, self._clock())
            self.rollbacks.append(event)
            del self.rollbacks[:-32]
            for listener in self._listeners:
                listener(event)
        return self.policy

    def add_rollback_listener(self, listener: Callable[[RollbackEvent], object]) -> None:
        """Also call ``listener`` after each rollback (with the new policy in place)."""
        self._listeners.append(listener)

    def record(self, version: str, *, failed: bool, ttft_s: float | None) -> str | None:
        """Count one served request of ``version``; returns the reason when it triggers a rollback."""
        counters = self.counters.get(version)
        if counters is None:
            return None
        counters.requests += 1
        counters.errors += failed
        rule = self.policy.rollback
        if rule is None:
            return None
        now = self._clock()
        self._samples[version].items.append((now, failed, ttft_s))
        if version == self.policy.primary or version not in self.policy.canaries():
            return None
        reason = self.judge(version, now)
        if reason is not None:
            self.rollback(reason)
        return reason

    def judge(self, canary: str, now: float | None = None) -> str | None:
        """Why ``canary`` should be rolled back now under the policy's rule, or None."""
        rule = self.policy.rollback
        if rule is None:
            return None
        now = self._clock() if now is None else now
        mine, base = self._samples[canary], self._samples[self.policy.primary]
        for s in (mine, base):
            s.prune(now - rule.window_s)
        if len(mine.items) < rule.min_samples or len(base.items) < rule.min_samples:
            return None
        errors, base_errors = mine.error_rate(), base.error_rate()
        if errors - base_errors > rule.error_rate_margin:
            return f"error rate {errors:.3f} > primary {base_errors:.3f} + {rule.error_rate_margin:g}"
        p99, base_p99 = mine.ttft_p99(), base.ttft_p99()
        if p99 is not None and base_p99 is not None and p99 - base_p99 > rule.ttft_p99_margin_s:
            margin_ms = rule.ttft_p99_margin_s * 1000
            return f"ttft p99 {p99 * 1000:.0f} ms > primary {base_p99 * 1000:.0f} ms + {margin_ms:.0f} ms"
        return None

    def window(self, version: str) -> tuple[int, float, float | None]:
        """Samples in the window, their error rate and TTFT p99 (seconds) for ``version``."""
        s = self._samples[version]
        if self.policy.rollback is not None:
            s.prune(self._clock() - self.policy.rollback.window_s)
        return len(s.items), s.error_rate(), s.ttft_p99()


def policy_to_json(policy: RolloutPolicy) -> dict[str, Any]:
    """``policy`` as a JSON object (the shared store's form; weights as pairs: their order matters)."""
    rule = policy.rollback
    return {
        "weights": [[v, w] for v, w in policy.weights.items()],
        "sticky": policy.sticky,
        "shadow": policy.shadow,
        "primary": policy.primary,
        "rollback": None
        if rule is None
        else {
            "error_rate_margin": rule.error_rate_margin,
            "ttft_p99_margin_s": rule.ttft_p99_margin_s,
            "window_s": rule.window_s,
            "min_samples": rule.min_samples,
        },
    }


def policy_from_json(data: Mapping[str, Any]) -> RolloutPolicy:
    """The policy :func:`policy_to_json` wrote; InvalidArgument when ``data`` is not one (not yet
    checked against a model's versions: :meth:`RolloutPolicy.check`)."""
    try:
        weights = {str(v): int(w) for v, w in data["weights"]}
        rule = data.get("rollback")
        return RolloutPolicy(
            weights,
            sticky=data.get("sticky", "chat"),
            shadow=data.get("shadow") or None,
            rollback=None if rule is None else RollbackRule(**rule),
            primary=str(data.get("primary") or ""),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgument(f"a stored rollout policy is malformed ({exc}); set it again") from None


def parse_weights(text: str) -> dict[str, int]:
    """``"v1=95,v2=5"`` -> ``{"v1": 95, "v2": 5}``; a bad pair raises InvalidArgument naming it."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, number = part.partition("=")
        if not sep or not name.strip() or not number.strip().isdigit():
            raise InvalidArgument(f"weight {part!r} must be version=number, e.g. v1=95,v2=5")
        out[name.strip()] = int(number)
    if not out:
        raise InvalidArgument("no weights given; pass them as version=number pairs, e.g. v1=95,v2=5")
    return out
