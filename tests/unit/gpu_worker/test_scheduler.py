"""The batching scheduler with a fake forward (fast), stepped as the engine loop steps it: step
composition, chunked prefill with decode first, priorities, KV accounting, forks, replay, failures."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from services.common.errors import ResourceExhausted
from services.common.generation import FinishReason
from services.common.sampling import SamplingParams
from services.gpu_worker.blocks import BlockManager
from services.gpu_worker.model import KVCache
from services.gpu_worker.plan import Segment
from services.gpu_worker.sampler import Sampler
from services.gpu_worker.scheduler import Scheduler, SeqState
from services.worker.types import SequenceOutput

VOCAB = 64
BT = 4
_ids = itertools.count(1)


class FakeForward:
    """Next token = (last input token + 1) % VOCAB; writes each token id into its KV slot (so block
    copies can be checked) and records every step's segments. ``fail`` makes the next call raise."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.steps: list[list[Segment]] = []
        self.fail: Exception | None = None

    def __call__(self, segments: Sequence[Segment]) -> list[torch.Tensor]:
        if self.fail is not None:
            error, self.fail = self.fail, None
            raise error
        self.steps.append(list(segments))
        out = []
        for seg in segments:
            for i, token in enumerate(seg.token_ids):
                pos = seg.start + i
                self.cache.k[0][seg.block_table[pos // BT] * BT + pos % BT] = float(token)
            rows = len(seg.token_ids) if seg.all_logits else 1
            logits = torch.zeros(rows, VOCAB)
            logits[-1, (seg.token_ids[-1] + 1) % VOCAB] = 1.0
            out.append(logits)
        return out


def make(num_blocks: int = 64, max_step_tokens: int = 8) -> tuple[Scheduler, FakeForward]:
    cache = KVCache(k=[torch.zeros(num_blocks * BT, 1, 2)], v=[torch.zeros(num_blocks * BT, 1, 2)], block_tokens=BT)
    forward = FakeForward(cache)
    s = Scheduler(forward, cache, BlockManager(num_blocks, BT, 100), max_step_tokens=max_step_tokens)
    return s, forward


def seq(prompt: list[int], max_new: int, priority: int = 0, replay: Sequence[int] = ()) -> SeqState:
    return SeqState(
        tokens=list(prompt),
        prompt_len=len(prompt),
        replay=deque(replay),
        sampler=Sampler(SamplingParams(max_tokens=max_new)),
        max_new=max_new,
        eos=frozenset(),
        id=next(_ids),
        priority=priority,
    )


class Outputs:
    """Every output of the steps run through it, by sequence id."""

    def __init__(self, s: Scheduler) -> None:
        self.s = s
        self.tokens: dict[int, list[int]] = {}
        self.last: dict[int, SequenceOutput] = {}
        self.prefill: dict[int, int] = {}
        """Each sequence's ``prefill_tokens`` (its first output's)."""

    def step(self) -> list[SequenceOutput]:
        outputs = self.s.step()
        for out in outputs:
            self.tokens.setdefault(out.id, []).extend(out.tokens)
            self.last[out.id] = out
            if out.prefill_tokens is not None:
                self.prefill[out.id] = out.prefill_tokens
        return outputs

    def ended(self, state: SeqState) -> bool:
        out = self.last.get(state.id)
        return out is not None and (out.finish is not None or out.error is not None)

    def run(self, *states: SeqState, max_steps: int = 500) -> list[list[int]]:
        """Step until every state has ended (then closes them, as the engine does)."""
        for _ in range(max_steps):
            if all(self.ended(st) for st in states):
                for st in states:
                    self.s.close(st)
                return [self.tokens.get(st.id, []) for st in states]
            assert self.s.has_work(), "the scheduler has no work but sequences have not ended"
            self.step()
        raise AssertionError("sequences did not end")


def test_tokens_follow_the_model_and_blocks_are_freed_on_close() -> None:
    s, _ = make()
    state = seq([1, 2, 3], 5)
    s.submit(state)
    o = Outputs(s)
    while not o.ended(state):
        o.step()
    assert o.tokens[state.id] == [4, 5, 6, 7, 8]
    assert o.last[state.id].finish == FinishReason.LENGTH
    assert s.blocks.used == 2  # (3 + 5) tokens / 4 per block, reserved until closed
    s.close(state)
    assert s.blocks.used == 0 and not s.has_work()


def test_only_the_first_token_reports_the_tokens_prefilled() -> None:
    s, _ = make()
    state = seq(list(range(10)), 3)
    s.submit(state)
    o = Outputs(s)
    firsts = []
    while not o.ended(state):
        firsts += [out.prefill_tokens for out in o.step() if out.tokens]
    assert firsts == [10, None, None]
    s.close(state)


def test_a_long_prompt_is_chunked_while_running_streams_decode_in_every_step() -> None:
    s, forward = make(max_step_tokens=8)
    short = seq([1], 40)
    s.submit(short)
    o = Outputs(s)
    o.step()
    assert o.tokens[short.id] == [2]
    long = seq(list(range(30)), 2)
    s.submit(long)
    chunks = []
    while long.id not in o.tokens:
        before = len(o.tokens[short.id])
        o.step()
        step = forward.steps[-1]
        assert sum(len(seg.token_ids) for seg in step) <= 8  # the step's token budget
        assert step[0].token_ids == [o.tokens[short.id][-2]]  # decode first: the stream's row leads
        assert len(o.tokens[short.id]) == before + 1  # the stream never stalls behind the prompt
        chunks += [len(seg.token_ids) for seg in step[1:]]
    # 7 tokens of budget beside the decode row, cut to whole blocks but the last chunk
    assert chunks == [4, 4, 4, 4, 4, 4, 6]
    assert o.run(long) == [[30, 31]]
    s.close(short)


def test_higher_priority_is_admitted_first_when_kv_is_short() -> None:
    s, _ = make(num_blocks=2)
    first = seq([1, 2, 3, 4], 4)  # holds both blocks
    s.submit(first)
    o = Outputs(s)
    o.step()
    assert first.admitted
    low, high = seq([10, 11, 12, 13], 4, priority=0), seq([20, 21, 22, 23], 4, priority=5)
    s.submit(low)
    s.submit(high)
    assert o.run(first) == [[5, 6, 7, 8]]
    o.step()
    assert high.admitted and not low.admitted  # low waits for the blocks high holds
    assert o.run(high) == [[24, 25, 26, 27]]
    assert o.run(low) == [[14, 15, 16, 17]]
    assert s.blocks.used == 0


def test_admission_waits_for_blocks_and_a_stalled_queue_is_no_work_until_blocks_free() -> None:
    s, _ = make(num_blocks=4)
    with s.lock:
        outside = s.blocks.allocate(3)  # e.g. a speculative sequence's blocks
    assert outside is not None
    waiting = seq([1, 2, 3, 4], 4)  # needs 2 blocks, 1 available
    s.submit(waiting)
    assert s.has_work()
    assert s.step() == [] and not waiting.admitted
    assert not s.has_work()  # the loop sleeps instead of running empty steps
    with s.lock:
        s.blocks.release(outside)
    assert s.has_work()
    o = Outputs(s)
    assert o.run(waiting) == [[5, 6, 7, 8]]


def test_a_new_sequence_ends_a_stall_it_can_pass() -> None:
    s, _ = make(num_blocks=4)
    with s.lock:
        outside = s.blocks.allocate(2)
    assert outside is not None
    big = seq([1] * 8, 4)  # 3 blocks: waits
    s.submit(big)
    s.step()
    assert not s.has_work()
    small = seq([5], 3, priority=9)  # one block, admitted before big
    s.submit(small)
    assert s.has_work()
    o = Outputs(s)
    assert o.run(small) == [[6, 7, 8]]
    assert not big.admitted
    s.close(big)
    with s.lock:
        s.blocks.release(outside)


def test_request_larger_than_the_kv_budget_is_refused() -> None:
    s, _ = make(num_blocks=2)
    with pytest.raises(ResourceExhausted, match="KV budget"):
        s.submit(seq([1, 2, 3], 20))
    assert not s.waiting


def test_close_frees_blocks_at_once_and_the_sequence_is_never_stepped_again() -> None:
    s, forward = make()
    state, other = seq([1, 2, 3], 200), seq([9], 5)
    s.submit(state)
    s.submit(other)
    o = Outputs(s)
    o.step()
    o.step()
    used = s.blocks.used
    s.close(state)
    assert s.blocks.used == used - -(-203 // BT)
    steps = len(forward.steps)
    o.run(other)
    assert len(o.tokens[state.id]) == 2  # nothing after the close
    assert all(len(step) == 1 for step in forward.steps[steps:])  # only the other sequence's row
    assert s.blocks.used == 0


def test_close_of_a_waiting_sequence_removes_it_from_the_queue() -> None:
    s, _ = make(num_blocks=2)
    first = seq([1, 2, 3, 4], 4)
    s.submit(first)
    o = Outputs(s)
    o.step()
    queued = seq([10, 11, 12, 13], 4)
    s.submit(queued)
    s.close(queued)
    assert queued not in s.waiting
    o.run(first)
    assert not s.has_work() and queued.id not in o.tokens


def test_prefix_blocks_are_shared_and_cached_after_release() -> None:
    s, _ = make()
    keys = lambda ids: [f"k{tuple(ids[: i + BT])}" for i in range(0, len(ids) - BT + 1, BT)]  # noqa: E731
    a = seq(list(range(10)), 2)
    a.key_fn = keys
    a.keys = keys(a.tokens)
    s.submit(a)
    o = Outputs(s)
    o.run(a)
    assert s.blocks.used == 0 and s.blocks.usage().cached_bytes > 0
    b = seq(list(range(10)), 2)
    b.key_fn = keys
    b.keys = keys(b.tokens)
    s.submit(b)
    assert o.run(b) == [[10, 11]]
    assert b.reused_local == 8 and b.prefilled == 2  # two full blocks reused, the rest prefilled
    assert o.prefill[b.id] == 2


def test_a_resumed_stream_replays_its_tokens_one_step_each_and_never_outputs_them() -> None:
    s, forward = make()
    state = seq([1, 2, 3], 3, replay=[4, 5])
    s.submit(state)
    o = Outputs(s)
    [tokens] = o.run(state)
    assert tokens == [6, 7, 8]
    assert [seg.token_ids for step in forward.steps for seg in step][:3] == [[1, 2, 3], [4], [5]]
    assert o.prefill[state.id] == 3 + 2  # the prompt and the replayed tokens ran through the model


def test_forks_share_the_prompts_full_blocks_and_copy_its_partial_block() -> None:
    s, _ = make()
    source = seq([1, 2, 3, 4, 5, 6], 3)  # one full block, a partial one
    forks = [seq([1, 2, 3, 4, 5, 6], 3) for _ in range(2)]
    s.submit(source, forks)
    o = Outputs(s)
    first = o.step()
    assert {out.id for out in first} == {source.id, *(f.id for f in forks)}  # one prefill, three tokens
    assert {out.id: out.prefill_tokens for out in first} == {source.id: 6, forks[0].id: 0, forks[1].id: 0}
    assert s.forks_made == 2
    for fork in forks:
        assert fork.blocks[0] == source.blocks[0]  # shared by reference
        assert fork.blocks[1] != source.blocks[1]
        assert torch.equal(s.cache.read_block(fork.blocks[1]), s.cache.read_block(source.blocks[1]))
    # 3 + 2 x 2 blocks: (6 + 3) / 4 each, the full prompt block shared
    assert s.blocks.used == 3 + 2 * 2
    assert o.run(source, *forks) == [[7, 8, 9]] * 3  # greedy choices equal the single stream
    assert s.blocks.used == 0


def test_forks_of_a_source_closed_before_its_prefill_ended_end_cancelled() -> None:
    s, _ = make(max_step_tokens=4)
    source = seq(list(range(12)), 3)
    forks = [seq(list(range(12)), 3) for _ in range(2)]
    s.submit(source, forks)
    o = Outputs(s)
    o.step()  # one chunk of the prompt, the forks' blocks reserved
    assert s.blocks.used > 0
    s.close(source)
    assert s.blocks.used == 0  # the forks' reserved blocks too
    assert s.has_work()
    outputs = o.step()
    assert sorted((out.id, out.finish) for out in outputs) == [(f.id, FinishReason.CANCELLED) for f in forks]


def test_a_failed_step_fails_its_sequences_and_the_next_step_runs() -> None:
    s, forward = make()
    a, b = seq([1, 2], 4), seq([7], 4)
    s.submit(a)
    s.submit(b)
    forward.fail = RuntimeError("device lost")
    o = Outputs(s)
    outputs = o.step()
    assert {out.id for out in outputs} == {a.id, b.id}
    assert all(isinstance(out.error, RuntimeError) for out in outputs)
    s.close(a)
    s.close(b)
    assert s.blocks.used == 0
    c = seq([20], 2)
    s.submit(c)
    assert o.run(c) == [[21, 22]]


class CountingConstraint:
    """Allows every token; records the tokens it was advanced over."""

    def __init__(self) -> None:
        self.advanced: list[int] = []

    def advance(self, token: int) -> None:
        self.advanced.append(token)

    def allowed(self) -> np.ndarray:
        return np.ones(VOCAB, dtype=bool)

    def bitmask(self) -> None:
        return None


def test_replayed_tokens_count_for_the_penalties_but_do_not_advance_the_grammar_again() -> None:
    """``NewSequence.constraint`` comes advanced over the replay (the runtime does it)."""
    s, _ = make()
    constraint = CountingConstraint()
    state = seq([1, 2, 3], 2, replay=[4, 5])
    state.sampler = Sampler(SamplingParams(max_tokens=2, presence_penalty=0.5), [1, 2, 3], (), constraint)  # type: ignore[arg-type]
    s.submit(state)
    assert Outputs(s).run(state) == [[6, 7]]
    assert constraint.advanced == [6, 7]
    penalties = state.sampler.penalties
    assert penalties is not None and penalties.generated == 4  # replayed 4, 5 and generated 6, 7
