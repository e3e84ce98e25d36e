"""Scheduler.import_blocks (Worker.ImportKV's hand-off to the engine loop) with a fake forward: the
calling thread waits while the loop thread writes the blocks between two steps; they are cached,
evictable and reused."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from services.common.errors import Unavailable
from services.gpu_worker.scheduler import Scheduler
from tests.unit.gpu_worker.test_scheduler import BT, Outputs, make, seq


def keys_of(ids: list[int]) -> list[str]:
    return [f"k{tuple(ids[: i + BT])}" for i in range(0, len(ids) - BT + 1, BT)]


def block(value: float) -> torch.Tensor:
    """One block in the Redis layout of the fake cache: [layers=1, 2, kv_heads=1, BT, head_dim=2]."""
    return torch.full((1, 2, 1, BT, 2), value)


def imported(s: Scheduler, keys: list[str], data: list[torch.Tensor]) -> int:
    """``import_blocks`` from another thread (as Worker.ImportKV calls it) while this thread steps the
    scheduler as the engine loop does (woken by the import)."""
    woken = threading.Event()
    s.wake = woken.set
    with ThreadPoolExecutor(1) as pool:
        future: Future[int] = pool.submit(s.import_blocks, keys, data)
        assert woken.wait(30)  # the import woke the loop
        while s.has_work():  # the step that writes the import (and any other work)
            s.step()
        return future.result(30)


def test_imported_blocks_are_cached_unreferenced_and_reused_by_the_next_prompt() -> None:
    s, _ = make()
    prompt = list(range(10))
    keys = keys_of(prompt)  # two full blocks
    assert imported(s, keys, [block(1.0), block(2.0)]) == 2
    assert s.blocks.used == 0 and s.blocks.usage().cached_bytes == 2 * 100
    with s.lock:
        ids = s.blocks.acquire_prefix(keys)
        s.blocks.release(ids)
    assert torch.equal(s.cache.read_block(ids[0]), block(1.0))
    assert torch.equal(s.cache.read_block(ids[1]), block(2.0))
    b = seq(prompt, 2)
    b.key_fn = keys_of
    b.keys = keys
    s.submit(b)
    assert Outputs(s).run(b) == [[10, 11]]
    assert (b.reused_local, b.reused_redis, b.prefilled) == (8, 0, 2)


def test_blocks_cached_already_are_skipped() -> None:
    s, _ = make()
    keys = keys_of(list(range(12)))
    assert imported(s, keys[:1], [block(1.0)]) == 1
    assert imported(s, keys, [block(9.0), block(2.0), block(3.0)]) == 2
    with s.lock:
        ids = s.blocks.acquire_prefix(keys)
        s.blocks.release(ids)
    assert len(ids) == 3 and torch.equal(s.cache.read_block(ids[0]), block(1.0))  # not overwritten


def test_an_import_is_written_between_two_steps_of_running_sequences() -> None:
    s, _ = make()
    live = seq([50, 51], 40)
    s.submit(live)
    o = Outputs(s)
    o.step()
    woken = threading.Event()
    s.wake = woken.set
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(s.import_blocks, keys_of(list(range(8))), [block(1.0), block(2.0)])
        assert woken.wait(30)
        o.step()  # writes the blocks, then runs the live sequence's decode row
        assert future.result(30) == 2
    assert len(o.tokens[live.id]) == 2
    with s.lock:
        assert s.blocks.cached_prefix(keys_of(list(range(8)))) == 2
    s.close(live)


def test_import_stops_where_the_budget_has_no_room_and_keeps_the_chain_head() -> None:
    s, _ = make(num_blocks=4)
    live = seq([50, 51, 52, 53], 4)  # holds 2 of the 4 blocks while it runs
    s.submit(live)
    Outputs(s).step()
    keys = keys_of(list(range(16)))
    assert imported(s, keys[:1], [block(1.0)]) == 1  # the chain's head, cached
    # 3 more wanted, 1 block free: the head is pinned, so it is not evicted to make room
    assert imported(s, keys, [block(1.0), block(2.0), block(3.0), block(4.0)]) == 1
    with s.lock:
        assert s.blocks.cached_prefix(keys) == 2
    s.close(live)


def test_a_waiting_import_fails_when_the_scheduler_stops() -> None:
    s, _ = make()
    woken = threading.Event()
    s.wake = woken.set
    with ThreadPoolExecutor(1) as pool:  # nobody steps: the import waits for the loop
        future = pool.submit(s.import_blocks, keys_of([1, 2, 3, 4]), [block(1.0)])
        assert woken.wait(30) and s.imports and not future.done()
        s.stop()
        with pytest.raises(Unavailable, match="the worker is shutting down; import the prefix into another replica"):
            future.result(30)
    with pytest.raises(Unavailable):
        s.import_blocks(keys_of([1, 2, 3, 4]), [block(1.0)])  # refused at once after the stop


def test_a_failed_write_frees_the_blocks_and_reports_the_error() -> None:
    s, _ = make()

    def broken(ids: object, data: object) -> None:
        raise ValueError("a KV block with 5 heads does not split over 3 ranks")

    s.write_blocks = broken
    with pytest.raises(ValueError, match="does not split"):
        imported(s, keys_of(list(range(8))), [block(1.0), block(2.0)])
    assert s.blocks.used == 0 and s.blocks.usage().cached_bytes == 0
