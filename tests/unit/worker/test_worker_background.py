"""A background turn (a batch line) reaches the engine's sequence marked so: from the worker start frame
the router sends to the sequence the batched edge engine holds out of foreground prefills."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from services.common.sampling import SamplingParams
from services.router.stream_transport import _start_pb
from services.router.worker_stream import TurnStart
from services.worker.runner import run_sequence
from services.worker.stats import WorkerCounters
from services.worker.types import GenerationRequest
from tests.unit.worker.fakes import TOKENIZER, FakeEngine, FakeSequence

PROMPT = tuple(TOKENIZER.encode("hi"))


class YieldingEngine(FakeEngine):
    """Its sequences have a ``background`` attribute, as the batched edge engine's do."""

    def __init__(self) -> None:
        super().__init__("ab", loop=False)
        self.sequences: list[FakeSequence] = []

    def start(self, token_ids: Sequence[int], sampling: SamplingParams, replay: Sequence[int] = ()) -> FakeSequence:
        seq = super().start(token_ids, sampling, replay)
        seq.background = None  # type: ignore[attr-defined]  # unset: the runner must set it either way
        self.sequences.append(seq)
        return seq


def test_the_start_frame_carries_the_background_mark() -> None:
    start = TurnStart(request_id="r", prompt_ids=[1, 2], sampling=SamplingParams(max_tokens=2), tenant="t")
    assert not _start_pb(start).background
    assert _start_pb(TurnStart("r", [1, 2], SamplingParams(max_tokens=2), "t", background=True)).background


def test_the_runner_marks_the_engines_sequence() -> None:
    for background in (True, False):
        engine = YieldingEngine()
        request = GenerationRequest(PROMPT, SamplingParams(max_tokens=2), background=background)
        run_sequence(engine, request, threading.Event(), lambda _event: None, WorkerCounters())
        assert [s.background for s in engine.sequences] == [background]  # type: ignore[attr-defined]


def test_an_engine_without_the_attribute_is_left_alone() -> None:
    request = GenerationRequest(PROMPT, SamplingParams(max_tokens=2), background=True)
    run_sequence(FakeEngine("ab", loop=False), request, threading.Event(), lambda _event: None, WorkerCounters())
