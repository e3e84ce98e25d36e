"""Steps an engine in this thread for the in-process edge benchmarks: what the worker's engine loop
does (services/worker/loop.py: add, then ``step()`` back to back while there is work), without its
thread or the runtime's output processing, so a benchmark times the engine alone.

    stepper = Stepper(engine)
    ids = [stepper.add(prompt, SamplingParams(max_tokens=48)) for _ in range(16)]
    streams = stepper.run()          # until every sequence added has ended
    streams[ids[0]].tokens, streams[ids[0]].stamps
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.common.generation import FinishReason
from services.common.sampling import SamplingParams
from services.worker.types import Engine, NewSequence

if TYPE_CHECKING:
    from services.worker.grammar import TokenConstraint

_ids = itertools.count(1)  # unique across steppers of one engine


@dataclass
class Stream:
    """One sequence's tokens, and when each step's output for it came (``time.perf_counter``)."""

    added: float
    tokens: list[int] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)
    """One per token (the tokens of one output share its stamp)."""
    finish: FinishReason | None = None
    error: BaseException | None = None

    @property
    def ended(self) -> bool:
        return self.finish is not None or self.error is not None


class Stepper:
    """One engine, stepped by the calling thread (see the module docstring)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.streams: dict[int, Stream] = {}
        engine.bind(lambda: None)  # this thread asks ``next_step_in`` before every step anyway

    def add(
        self,
        prompt: Sequence[int],
        sampling: SamplingParams,
        *,
        constraint: TokenConstraint | None = None,
        **options: Any,
    ) -> int:
        """Add one sequence (``options``: the other fields of :class:`NewSequence`); its id."""
        seq = NewSequence(next(_ids), tuple(prompt), sampling, constraint=constraint, **options)
        self.streams[seq.id] = Stream(time.perf_counter())
        self.engine.add(seq)
        return seq.id

    def run(self) -> dict[int, Stream]:
        """Step until every sequence added has ended (a sequence's error is raised here)."""
        engine = self.engine
        while not all(stream.ended for stream in self.streams.values()):
            wait = engine.next_step_in()
            if wait is None:
                raise RuntimeError("the engine has nothing to do but sequences have not ended")
            if wait > 0:
                time.sleep(wait)  # held batch lines only (none in these benchmarks)
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                stream = self.streams.get(out.id)
                if stream is None:
                    continue
                if out.error is not None:
                    raise out.error
                stream.tokens += out.tokens
                stream.stamps += [now] * len(out.tokens)
                if out.finish is not None:
                    stream.finish = out.finish
        return self.streams
