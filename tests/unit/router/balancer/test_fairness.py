from __future__ import annotations

from collections import Counter

from services.router.balancer.fairness import FairQueue


def test_heavy_tenant_cannot_starve_a_light_one_under_saturation() -> None:
    """One slot; the heavy tenant queued 200 large requests before the light tenant's 10 small ones."""
    q: FairQueue[tuple[str, int]] = FairQueue()
    for i in range(200):
        q.push(("heavy", i), tenant="heavy", cost=1000)
    for i in range(10):
        q.push(("light", i), tenant="light", cost=100)
    order = [q.pop() for _ in range(30)]
    light_positions = [i for i, item in enumerate(order) if item and item[0] == "light"]
    assert len(light_positions) == 10, "all light requests are served among the first 30 releases"
    assert light_positions[0] <= 1
    # FIFO would have served none of them in 200 releases.


def test_token_weighted_share_between_backlogged_tenants() -> None:
    q: FairQueue[str] = FairQueue()
    for _ in range(300):
        q.push("big", tenant="big", cost=400)  # 4x the tokens per request
        q.push("small", tenant="small", cost=100)
    served: Counter[str] = Counter()
    tokens: Counter[str] = Counter()
    for _ in range(100):
        item = q.pop()
        assert item is not None
        served[item] += 1
        tokens[item] += 400 if item == "big" else 100
    assert abs(tokens["big"] - tokens["small"]) <= 400  # equal token shares, not equal request counts
    assert served["small"] > 3 * served["big"]


def test_weights_and_priorities() -> None:
    q: FairQueue[str] = FairQueue(weights={"gold": 3.0})
    for _ in range(40):
        q.push("gold", tenant="gold", cost=100)
        q.push("free", tenant="free", cost=100)
    first = Counter(q.pop() for _ in range(40))
    assert 28 <= first["gold"] <= 32  # 3:1
    q.push("urgent", tenant="free", cost=10_000, priority=5)
    assert q.pop() == "urgent"  # a higher priority class goes first
    assert q.ahead_of(0) == len(q) and q.ahead_of(9) == 0


def test_remove_withdraws_a_waiter() -> None:
    q: FairQueue[str] = FairQueue()
    a = q.push("a", tenant="t", cost=1)
    q.push("b", tenant="t", cost=1)
    q.remove(a)
    assert len(q) == 1 and q.pop() == "b" and q.pop() is None
    q.remove(a)  # idempotent
    assert len(q) == 0


def test_tenants_that_come_and_go_leave_a_bounded_memory_and_fairness_holds() -> None:
    q: FairQueue[str] = FairQueue(max_tenants=100)
    for i in range(20_000):  # one request each from 20,000 tenants, queued in waves and released
        q.push(f"t{i}", tenant=f"tenant-{i}", cost=1 + i % 500)
        if i % 50 == 49:
            while q.pop() is not None:
                pass
        assert len(q._finish) <= 101
    while q.pop() is not None:
        pass
    # The queue still shares fairly once the churn is over.
    for i in range(200):
        q.push(f"heavy{i}", tenant="heavy", cost=1000)
    for i in range(10):
        q.push(f"light{i}", tenant="light", cost=100)
    order = [q.pop() for _ in range(30)]
    assert sum(1 for item in order if item and item.startswith("light")) == 10


def test_a_tag_at_or_below_virtual_time_is_forgotten_first_and_that_changes_no_tag() -> None:
    q: FairQueue[str] = FairQueue(max_tenants=4)
    q.push("old", tenant="old", cost=10)  # S=0, F=10
    for _ in range(3):
        q.push("busy", tenant="busy", cost=100)  # S=0, 100, 200 (F=300)
    while q.pop() is not None:
        pass  # V is now 200
    q._forget_tenants()
    assert q._finish == {"busy": 300.0}  # old's tag (10 <= V) is gone; busy's (300 > V) is kept
    q.push("old again", tenant="old", cost=10)
    q.push("busy again", tenant="busy", cost=10)
    # old's next request is tagged V=200 as it would have been with F=10 remembered; busy's 300.
    assert sorted(e.key[1] for e in q._heap if not e.removed) == [200.0, 300.0]
    assert q.pop() == "old again"


def test_withdrawn_waiters_do_not_pile_up_in_the_heap() -> None:
    q: FairQueue[int] = FairQueue()
    entries = [q.push(i, tenant=f"t{i % 7}", cost=10) for i in range(10_000)]
    for entry in entries[1:]:  # every waiter but the first gives up; nothing is released meanwhile
        q.remove(entry)
    assert len(q) == 1 and len(q._heap) <= 2 * len(q) + 64
    assert q.pop() == 0 and q.pop() is None
