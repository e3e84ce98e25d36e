"""The rollout domain (services/router/frontend/rollout.py): canary split, stickiness, rollback decisions."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from services.common.errors import InvalidArgument
from services.router.frontend.rollout import (
    RollbackEvent,
    RollbackRule,
    Rollout,
    RolloutPolicy,
    parse_weights,
    pick,
    policy_from_json,
    policy_to_json,
    tenant_point,
)

VERSIONS = ("v1", "v2", "v3")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def rollout(policy: RolloutPolicy, **kw: object) -> Rollout:
    return Rollout("m", VERSIONS, policy, rng=random.Random(7), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_canary_split_is_within_3_percent_of_its_weight_over_2000_requests(seed: int) -> None:
    r = Rollout("m", VERSIONS, RolloutPolicy({"v1": 95, "v2": 5}), rng=random.Random(seed))
    counts = Counter(r.choose() for _ in range(2000))
    assert set(counts) <= {"v1", "v2"}
    assert abs(counts["v2"] / 2000 - 0.05) <= 0.03
    assert abs(counts["v1"] / 2000 - 0.95) <= 0.03


def test_an_even_split_and_zero_weights() -> None:
    r = rollout(RolloutPolicy({"v1": 50, "v2": 50, "v3": 0}))
    counts = Counter(r.choose() for _ in range(2000))
    assert counts["v3"] == 0
    assert abs(counts["v1"] / 2000 - 0.5) <= 0.03


def test_tenant_stickiness_keeps_each_tenant_on_one_version_and_splits_tenants_by_weight() -> None:
    r = rollout(RolloutPolicy({"v1": 90, "v2": 10}, sticky="tenant"))
    tenants = [f"tenant-{i}" for i in range(2000)]
    first = {t: r.choose(t) for t in tenants}
    assert all(r.choose(t) == first[t] for t in tenants for _ in range(3))
    share = sum(v == "v2" for v in first.values()) / len(tenants)
    assert abs(share - 0.10) <= 0.03
    # Stable across processes: a hash of model and tenant, no per-process salt.
    assert tenant_point("m", "acme") == tenant_point("m", "acme")
    assert tenant_point("m", "acme") != tenant_point("other", "acme")


def test_raising_a_canary_moves_only_tenants_across_the_boundary() -> None:
    small = RolloutPolicy({"v1": 95, "v2": 5}, sticky="tenant")
    big = RolloutPolicy({"v1": 50, "v2": 50}, sticky="tenant")
    for i in range(500):
        point = tenant_point("m", f"t{i}")
        if pick(small, point) == "v2":
            assert pick(big, point) == "v2"  # a canary tenant stays on the canary as it grows


def test_policies_naming_unknown_versions_or_no_traffic_are_refused() -> None:
    r = rollout(RolloutPolicy({"v1": 100}))
    with pytest.raises(InvalidArgument, match="no version 'v9'"):
        r.set_policy(RolloutPolicy({"v9": 100}))
    with pytest.raises(InvalidArgument, match="add up to 0"):
        r.set_policy(RolloutPolicy({"v1": 0}))
    with pytest.raises(InvalidArgument, match="to shadow"):
        r.set_policy(RolloutPolicy({"v1": 100}, shadow="v9"))
    with pytest.raises(InvalidArgument, match="sticky"):
        r.set_policy(RolloutPolicy({"v1": 100}, sticky="user"))  # type: ignore[arg-type]
    assert r.policy.weights == {"v1": 100}  # a refused policy changes nothing
    with pytest.raises(InvalidArgument, match="version=number"):
        parse_weights("v1=95,v2")
    assert parse_weights("v1=95, v2=5") == {"v1": 95, "v2": 5}


def test_the_primary_is_the_heaviest_version_and_rollback_returns_all_weight_to_it() -> None:
    events: list[RollbackEvent] = []
    r = rollout(RolloutPolicy({"v2": 5, "v1": 95}, shadow="v3"), on_rollback=events.append)
    assert r.policy.primary == "v1"
    policy = r.rollback()
    assert policy.weights == {"v2": 0, "v1": 100} and policy.shadow is None
    assert [(e.version, e.to, e.reason) for e in events] == [("v2", "v1", "manual")]
    assert {r.choose() for _ in range(200)} == {"v1"}


def _feed(r: Rollout, version: str, n: int, *, ttft: float, failed_every: int = 0) -> str | None:
    reason = None
    for i in range(n):
        failed = bool(failed_every) and i % failed_every == 0
        reason = r.record(version, failed=failed, ttft_s=None if failed else ttft) or reason
    return reason


def test_a_slow_canary_is_rolled_back_automatically() -> None:
    clock = Clock()
    events: list[RollbackEvent] = []
    rule = RollbackRule(error_rate_margin=0.05, ttft_p99_margin_s=0.2, window_s=30, min_samples=20)
    r = rollout(RolloutPolicy({"v1": 90, "v2": 10}, rollback=rule), clock=clock, on_rollback=events.append)
    assert _feed(r, "v1", 40, ttft=0.05) is None
    assert _feed(r, "v2", 19, ttft=0.9) is None  # below min_samples: not judged yet
    reason = _feed(r, "v2", 1, ttft=0.9)
    assert reason is not None and "ttft p99" in reason
    assert r.policy.weights == {"v1": 100, "v2": 0}
    assert len(events) == 1 and events[0].version == "v2" and events[0].to == "v1"


def test_an_erroring_canary_is_rolled_back_and_a_healthy_one_is_not() -> None:
    clock = Clock()
    rule = RollbackRule(error_rate_margin=0.05, ttft_p99_margin_s=1.0, window_s=30, min_samples=20)
    r = rollout(RolloutPolicy({"v1": 90, "v2": 10}, rollback=rule), clock=clock)
    _feed(r, "v1", 100, ttft=0.05, failed_every=50)  # 2 %
    assert _feed(r, "v2", 40, ttft=0.06, failed_every=40) is None  # 2.5 %: within the margin
    assert r.policy.weights["v2"] == 10
    reason = _feed(r, "v2", 20, ttft=0.06, failed_every=2)
    assert reason is not None and "error rate" in reason
    assert r.policy.weights["v2"] == 0


def test_old_samples_leave_the_window() -> None:
    clock = Clock()
    rule = RollbackRule(ttft_p99_margin_s=0.2, window_s=10, min_samples=20)
    r = rollout(RolloutPolicy({"v1": 90, "v2": 10}, rollback=rule), clock=clock)
    _feed(r, "v1", 30, ttft=0.05)
    _feed(r, "v2", 15, ttft=0.9)
    clock.now += 11  # the slow samples age out before there are enough to judge
    _feed(r, "v1", 30, ttft=0.05)
    assert _feed(r, "v2", 15, ttft=0.9) is None
    assert r.window("v2")[0] == 15
    assert r.policy.weights["v2"] == 10


def test_no_rule_no_rollback() -> None:
    r = rollout(RolloutPolicy({"v1": 90, "v2": 10}))
    _feed(r, "v1", 100, ttft=0.01)
    assert _feed(r, "v2", 100, ttft=5.0, failed_every=1) is None
    assert r.counters["v2"].requests == 100 and r.counters["v2"].errors == 100


def test_a_policy_survives_its_json_form_with_the_order_of_its_weights() -> None:
    """The shared store's form (services/store/rollouts.py): the weights' order decides pick()."""
    rule = RollbackRule(error_rate_margin=0.1, ttft_p99_margin_s=0.3, window_s=30, min_samples=5)
    policy = RolloutPolicy({"v3": 10, "v1": 80, "v2": 10}, sticky="tenant", shadow="v2", rollback=rule)
    back = policy_from_json(json.loads(json.dumps(policy_to_json(policy), sort_keys=True)))
    assert back == policy and list(back.weights) == ["v3", "v1", "v2"] and back.primary == "v1"
    rolled = Rollout("m", VERSIONS, policy).rollback()
    assert policy_from_json(policy_to_json(rolled)).primary == "v1"  # kept, not recomputed
    for bad in ({}, {"weights": "v1"}, {"weights": [["v1"]]}, {"weights": [["v1", 1]], "rollback": {"x": 1}}):
        with pytest.raises(InvalidArgument, match="stored rollout policy is malformed"):
            policy_from_json(bad)


def test_check_names_the_field_at_fault() -> None:
    for policy, field in (
        (RolloutPolicy({"v9": 1}), "weights:"),
        (RolloutPolicy({"v1": 0}), "weights:"),
        (RolloutPolicy({"v1": 1}, shadow="v9"), "shadow:"),
        (RolloutPolicy({"v1": 1}, sticky="nope"), "sticky"),  # type: ignore[arg-type]
        (RolloutPolicy({"v1": 1, "v2": 0}, primary="v2"), "primary:"),
    ):
        with pytest.raises(InvalidArgument) as err:
            policy.check(VERSIONS, "m")
        assert err.value.message.startswith(field)
