"""The batching scheduler with a fake forward (fast): step composition, chunking, priorities, KV accounting."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

import pytest
import torch

from services.common.errors import ResourceExhausted
from services.common.sampling import SamplingParams
from services.gpu_worker.blocks import BlockManager
from services.gpu_worker.model import KVCache
from services.gpu_worker.plan import Segment
from services.gpu_worker.sampler import Sampler
from services.gpu_worker.scheduler import Scheduler, SeqState

VOCAB = 64
BT = 4


class FakeForward:
    """Next token = (last input token + 1) % VOCAB; records every step's segments."""

    def __init__(self) -> None:
        self.steps: list[list[Segment]] = []
        self.gate = threading.Semaphore(1000)

    def __call__(self, segments: Sequence[Segment]) -> list[torch.Tensor]:
        self.gate.acquire()
        self.steps.append(list(segments))
        out = []
        for seg in segments:
            rows = len(seg.token_ids) if seg.all_logits else 1
            logits = torch.zeros(rows, VOCAB)
            logits[-1, (seg.token_ids[-1] + 1) % VOCAB] = 1.0
            out.append(logits)
        return out


def make(num_blocks: int = 64, max_step_tokens: int = 8) -> tuple[Scheduler, FakeForward]:
    forward = FakeForward()
    cache = KVCache(k=[torch.zeros(num_blocks * BT, 1, 2)], v=[torch.zeros(num_blocks * BT, 1, 2)], block_tokens=BT)
    return Scheduler(forward, cache, BlockManager(num_blocks, BT, 100), max_step_tokens=max_step_tokens), forward


def seq(prompt: list[int], max_new: int, priority: int = 0) -> SeqState:
    return SeqState(
        tokens=list(prompt),
        prompt_len=len(prompt),
        replay=deque(),
        sampler=Sampler(SamplingParams(max_tokens=max_new)),
        max_new=max_new,
        eos=frozenset(),
        priority=priority,
    )


def drain(s: Scheduler, state: SeqState) -> list[int]:
    out = []
    while (token := s.next_token(state)) is not None:
        out.append(token)
    return out


def test_tokens_follow_the_model_and_blocks_are_freed() -> None:
    s, _ = make()
    state = seq([1, 2, 3], 5)
    s.submit(state)
    assert drain(s, state) == [4, 5, 6, 7, 8]
    assert s.blocks.used == 2  # (3 + 5) tokens / 4 per block, reserved until closed
    s.close(state)
    assert s.blocks.used == 0
    s.stop()


def test_long_prompt_is_chunked_while_running_streams_keep_decoding() -> None:
    s, forward = make(max_step_tokens=8)
    short = seq([1], 30)
    s.submit(short)
    assert s.next_token(short) == 2
    long = seq(list(range(40)), 2)
    s.submit(long)
    assert drain(s, long) == [40, 41]
    prefill_steps = [step for step in forward.steps if any(len(seg.token_ids) > 1 for seg in step)]
    assert len(prefill_steps) >= 40 // 8
    for step in prefill_steps:
        assert sum(len(seg.token_ids) for seg in step) <= 8
        # the running stream is served in the same step unless it is already `lookahead` ahead
        assert any(len(seg.token_ids) == 1 for seg in step) or len(short.out) >= s.lookahead
    s.close(short)
    s.close(long)
    s.stop()


def test_higher_priority_is_admitted_first_when_kv_is_short() -> None:
    s, forward = make(num_blocks=2)
    forward.gate = threading.Semaphore(0)  # hold the first step until all three are queued
    first = seq([1, 2, 3, 4], 4)
    s.submit(first)
    with s.cond:
        assert s.cond.wait_for(lambda: first.admitted, timeout=30)  # it holds both blocks now
    low, high = seq([10, 11, 12, 13], 4, priority=0), seq([20, 21, 22, 23], 4, priority=5)
    s.submit(low)
    s.submit(high)
    for _ in range(100):
        forward.gate.release()
    assert drain(s, first) == [5, 6, 7, 8]
    s.close(first)
    assert drain(s, high) == [24, 25, 26, 27]
    assert not low.admitted  # still waiting for the blocks high holds
    s.close(high)
    assert drain(s, low) == [14, 15, 16, 17]
    s.close(low)
    s.stop()


def test_request_larger_than_the_kv_budget_is_refused() -> None:
    s, _ = make(num_blocks=2)
    with pytest.raises(ResourceExhausted, match="KV budget"):
        s.submit(seq([1, 2, 3], 20))
    s.stop()


def test_close_stops_generation_and_frees_blocks_at_once() -> None:
    s, forward = make()
    state = seq([1, 2, 3], 200)
    s.submit(state)
    assert s.next_token(state) == 4
    s.close(state)
    assert s.blocks.used == 0 and state.closed
    steps = len(forward.steps)
    assert state.generated <= 1 + s.lookahead + 1
    assert s.next_token(state) is None
    assert len(forward.steps) == steps
    s.stop()


def test_prefix_blocks_are_shared_and_cached_after_release() -> None:
    s, _ = make()
    keys = lambda ids: [f"k{tuple(ids[: i + BT])}" for i in range(0, len(ids) - BT + 1, BT)]  # noqa: E731
    a = seq(list(range(10)), 2)
    a.key_fn = keys
    a.keys = keys(a.tokens)
    s.submit(a)
    drain(s, a)
    s.close(a)
    assert s.blocks.used == 0 and s.blocks.usage().cached_bytes > 0
    b = seq(list(range(10)), 2)
    b.key_fn = keys
    b.keys = keys(b.tokens)
    s.submit(b)
    assert drain(s, b) == [10, 11]
    assert b.reused_local == 8 and b.prefilled == 2  # two full blocks reused, the rest prefilled
    s.close(b)
    s.stop()


def test_a_consumer_is_woken_only_by_its_own_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    wakeups: dict[int, int] = {}
    wait = threading.Condition.wait

    def counting_wait(self: threading.Condition, timeout: float | None = None) -> bool:
        woken = wait(self, timeout)
        wakeups[threading.get_ident()] = wakeups.get(threading.get_ident(), 0) + 1
        return woken

    monkeypatch.setattr(threading.Condition, "wait", counting_wait)
    s, forward = make(num_blocks=64, max_step_tokens=64)
    forward.gate = threading.Semaphore(0)  # no step until every consumer is waiting
    states = [seq([i, i + 1], 12) for i in range(8)]
    for state in states:
        s.submit(state)
    results: list[list[int]] = [[] for _ in states]
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, drain(s, states[i]))) for i in range(8)]
    for t in threads:
        t.start()
    for _ in range(1000):
        forward.gate.release()
    for t in threads:
        t.join(30)
    assert results == [[(i + 2 + k) % VOCAB for k in range(12)] for i in range(8)]
    # A consumer wakes for its own steps only (the prefill, then one per token, then finished); with
    # one shared condition every token another consumer took woke it too (O(sequences^2) per step).
    for t in threads:
        assert wakeups.get(t.ident or 0, 0) <= 12 + 2
    for state in states:
        s.close(state)
    s.stop()


def test_close_from_another_thread_ends_a_consumer_waiting_for_admission() -> None:
    s, _ = make(num_blocks=2)
    first = seq([1, 2, 3, 4], 4)  # holds both blocks until it is closed
    s.submit(first)
    assert s.next_token(first) == 5
    queued = seq([10, 11, 12, 13], 4)
    s.submit(queued)
    got: list[int | None] = []
    consumer = threading.Thread(target=lambda: got.append(s.next_token(queued)))
    consumer.start()
    consumer.join(0.2)
    assert consumer.is_alive() and not queued.admitted
    s.close(queued)
    consumer.join(10)
    assert got == [None]
    s.close(first)
    s.stop()
