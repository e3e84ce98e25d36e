"""Scheduler.import_blocks (Worker.ImportKV's hand-off) with a fake forward: cached, evictable, reused."""

from __future__ import annotations

import threading

import pytest
import torch

from services.common.errors import Unavailable
from tests.unit.gpu_worker.test_scheduler import BT, drain, make, seq


def keys_of(ids: list[int]) -> list[str]:
    return [f"k{tuple(ids[: i + BT])}" for i in range(0, len(ids) - BT + 1, BT)]


def block(value: float) -> torch.Tensor:
    """One block in the Redis layout of the fake cache: [layers=1, 2, kv_heads=1, BT, head_dim=2]."""
    return torch.full((1, 2, 1, BT, 2), value)


def test_imported_blocks_are_cached_unreferenced_and_reused_by_the_next_prompt() -> None:
    s, _ = make()
    prompt = list(range(10))
    keys = keys_of(prompt)  # two full blocks
    assert s.import_blocks(keys, [block(1.0), block(2.0)]) == 2
    assert s.blocks.used == 0 and s.blocks.usage().cached_bytes == 2 * 100
    with s.cond:
        ids = s.blocks.acquire_prefix(keys)
        s.blocks.release(ids)
    assert torch.equal(s.cache.read_block(ids[0]), block(1.0))
    assert torch.equal(s.cache.read_block(ids[1]), block(2.0))
    b = seq(prompt, 2)
    b.key_fn = keys_of
    b.keys = keys
    s.submit(b)
    assert drain(s, b) == [10, 11]
    assert (b.reused_local, b.reused_redis, b.prefilled) == (8, 0, 2)
    s.close(b)
    s.stop()


def test_blocks_cached_already_are_skipped() -> None:
    s, _ = make()
    keys = keys_of(list(range(12)))
    assert s.import_blocks(keys[:1], [block(1.0)]) == 1
    assert s.import_blocks(keys, [block(9.0), block(2.0), block(3.0)]) == 2
    with s.cond:
        ids = s.blocks.acquire_prefix(keys)
        s.blocks.release(ids)
    assert len(ids) == 3 and torch.equal(s.cache.read_block(ids[0]), block(1.0))  # not overwritten
    s.stop()


def test_import_stops_where_the_budget_has_no_room_and_keeps_the_chain_head() -> None:
    s, _ = make(num_blocks=4)
    live = seq([50, 51, 52, 53], 4)  # holds 2 of the 4 blocks while it runs
    s.submit(live)
    assert s.next_token(live) == 54
    keys = keys_of(list(range(16)))
    assert s.import_blocks(keys[:1], [block(1.0)]) == 1  # the chain's head, cached
    # 3 more wanted, 1 block free: the head is pinned, so it is not evicted to make room
    assert s.import_blocks(keys, [block(1.0), block(2.0), block(3.0), block(4.0)]) == 1
    with s.cond:
        assert s.blocks.cached_prefix(keys) == 2
    s.close(live)
    s.stop()


def test_a_waiting_import_fails_when_the_scheduler_stops() -> None:
    s, forward = make()
    forward.gate = threading.Semaphore(0)  # the step in flight never ends: the import waits
    running = seq([1, 2], 3)
    s.submit(running)
    with s.cond:
        assert s.cond.wait_for(lambda: running.admitted, timeout=30)
    errors: list[Unavailable] = []

    def work() -> None:
        try:
            s.import_blocks(keys_of([1, 2, 3, 4]), [block(1.0)])
        except Unavailable as exc:
            errors.append(exc)

    t = threading.Thread(target=work)
    t.start()
    with s.cond:
        assert s.cond.wait_for(lambda: bool(s.imports), timeout=30)
    stopper = threading.Thread(target=s.stop)  # waits for the blocked step; the import gives up at once
    stopper.start()
    t.join(30)
    assert [str(e) for e in errors] == ["the worker is shutting down; import the prefix into another replica"]
    forward.gate.release(100)
    stopper.join(30)


def test_a_failed_write_frees_the_blocks_and_reports_the_error() -> None:
    s, _ = make()

    def broken(ids: object, data: object) -> None:
        raise ValueError("a KV block with 5 heads does not split over 3 ranks")

    s.write_blocks = broken
    with pytest.raises(ValueError, match="does not split"):
        s.import_blocks(keys_of(list(range(8))), [block(1.0), block(2.0)])
    assert s.blocks.used == 0 and s.blocks.usage().cached_bytes == 0
    s.stop()
