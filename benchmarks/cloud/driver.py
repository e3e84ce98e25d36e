"""Steps a cloud engine in this thread for the in-process cloud benchmarks: what the worker's engine
loop does (services/worker/loop.py: add, then ``step()`` back to back while there is work, sleeping
until the engine's wake-up when it has none), without its thread or the runtime's output processing,
so a benchmark times the engine alone.

    stepper = Stepper(engine)
    ids = [stepper.add(prompt, SamplingParams(max_tokens=48)) for prompt in prompts]
    streams = stepper.run()          # until every sequence added has ended
    streams[ids[0]].tokens, streams[ids[0]].stamps

The engine's wake-up matters here: a prompt whose prefix blocks are in Redis is loaded on the cloud
engine's I/O thread, and a sampled sequence may wait there for transformers' warpers; meanwhile the
engine may have nothing to step (``next_step_in() is None``) and the stepper waits for the wake-up.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.common.generation import FinishReason
from services.common.sampling import SamplingParams
from services.worker.types import Engine, NewSequence, SequenceOutput

_ids = itertools.count(1)  # unique across steppers of one engine


@dataclass
class Stream:
    """One sequence's outputs, and when each step's output for it came (``time.perf_counter``)."""

    added: float
    tokens: list[int] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)
    """One per token (the tokens of one output share its stamp)."""
    prefill_tokens: int | None = None
    finish: FinishReason | None = None
    error: BaseException | None = None

    @property
    def ended(self) -> bool:
        return self.finish is not None or self.error is not None

    @property
    def ttft(self) -> float:
        """Seconds from its add to its first token."""
        return self.stamps[0] - self.added


class Stepper:
    """One engine, stepped by the calling thread (see the module docstring)."""

    def __init__(self, engine: Engine, *, idle_timeout_s: float = 120.0) -> None:
        self.engine = engine
        self.streams: dict[int, Stream] = {}
        self.steps = 0
        self.idle_timeout_s = idle_timeout_s
        self._woken = threading.Event()
        engine.bind(self._woken.set)

    def add(self, prompt: Sequence[int], sampling: SamplingParams, **options: Any) -> int:
        """Add one sequence (``options``: the other fields of :class:`NewSequence`); its id. A refusal
        (e.g. ResourceExhausted beyond the KV budget) raises here."""
        seq = NewSequence(next(_ids), tuple(prompt), sampling, **options)
        self.streams[seq.id] = Stream(time.perf_counter())
        try:
            self.engine.add(seq)
        except BaseException:
            del self.streams[seq.id]
            raise
        return seq.id

    def stop(self, seq_id: int) -> None:
        """End a sequence now (its KV is freed before the next step)."""
        self.engine.stop(seq_id)
        stream = self.streams.get(seq_id)
        if stream is not None and not stream.ended:
            stream.finish = FinishReason.CANCELLED

    def step(self) -> list[SequenceOutput]:
        """One engine step once it has work (waiting for its wake-up meanwhile); its outputs."""
        self._wait_for_work()
        outputs = self.engine.step()
        self.steps += 1
        now = time.perf_counter()
        for out in outputs:
            stream = self.streams.get(out.id)
            if stream is None:
                continue
            stream.tokens += out.tokens
            stream.stamps += [now] * len(out.tokens)
            if out.prefill_tokens is not None:
                stream.prefill_tokens = out.prefill_tokens
            if out.finish is not None:
                stream.finish = out.finish
            if out.error is not None:
                stream.error = out.error
        return outputs

    def _wait_for_work(self) -> None:
        while True:
            self._woken.clear()  # before asking: a wake-up after the answer is not lost
            wait = self.engine.next_step_in()
            if wait is not None and wait <= 0:
                return
            if not self._woken.wait(self.idle_timeout_s if wait is None else wait) and wait is None:
                raise RuntimeError(f"the engine had nothing to do for {self.idle_timeout_s} s but sequences are live")

    def run(
        self, ids: Sequence[int] | None = None, *, after_step: Callable[[], None] | None = None
    ) -> dict[int, Stream]:
        """Step until every sequence of ``ids`` (default: all added) has ended (a sequence's error is
        raised here); ``after_step`` is called after each step."""
        wanted = list(self.streams) if ids is None else list(ids)
        while True:
            for seq_id in wanted:
                error = self.streams[seq_id].error
                if error is not None:
                    raise error
            if all(self.streams[i].ended for i in wanted):
                return {i: self.streams[i] for i in wanted}
            self.step()
            if after_step is not None:
                after_step()

    def run_until(self, done: Callable[[], bool]) -> None:
        """Step until ``done()`` (e.g. a sequence has its first tokens)."""
        while not done():
            self.step()

    def generate(self, prompt: Sequence[int], sampling: SamplingParams, **options: Any) -> list[int]:
        """The tokens of one sequence run to its end (an EOS included), stepping every live one."""
        seq_id = self.add(prompt, sampling, **options)
        return self.run([seq_id])[seq_id].tokens

    def close(self) -> None:
        """Stop every sequence still live (the engine itself stays open)."""
        for seq_id, stream in self.streams.items():
            if not stream.ended:
                self.stop(seq_id)
