from __future__ import annotations

from services.gpu_worker.blocks import BlockManager


def test_allocate_release_and_budget() -> None:
    m = BlockManager(4, 16, 1000)
    a = m.allocate(3)
    assert a is not None and m.used == 3 and m.usage().used_bytes == 3000
    assert m.allocate(2) is None  # all or nothing
    m.release(a)
    assert m.used == 0 and m.available == 4


def test_named_blocks_are_cached_shared_and_evicted_lru() -> None:
    m = BlockManager(3, 16, 1)
    a = m.allocate(2)
    assert a is not None
    m.register(a[0], "k0")
    m.register(a[1], "k1")
    m.release(a)
    assert m.used == 0 and m.usage().cached_bytes == 2 and m.is_cached("k0")
    shared = m.acquire_prefix(["k0", "k1", "k2"])
    assert shared == a and m.used == 2
    other = m.acquire_prefix(["k0"])
    assert other == [a[0]]
    m.release(shared)
    m.release(other)
    m.acquire_prefix(["k1"])  # k1 recently used: k0 becomes the eviction candidate
    m.release([a[1]])
    fresh = m.allocate(2)  # one free block + evicts the least recently used cached block (k0)
    assert fresh is not None and m.evicted_total == 1
    assert not m.is_cached("k0") and m.is_cached("k1")


def test_duplicate_key_keeps_the_first_holder() -> None:
    m = BlockManager(2, 16, 1)
    a, b = m.allocate(1), m.allocate(1)
    assert a is not None and b is not None
    m.register(a[0], "k")
    m.register(b[0], "k")
    assert m.key_of(b[0]) is None
    m.release(b)
    assert m.available == 1  # b was private: freed, not cached
