from __future__ import annotations

from collections import Counter

from services.router.fairness import FairQueue


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
