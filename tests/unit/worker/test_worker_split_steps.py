"""run_sequence with sequences that split ``step`` into ``begin``/``wait``: after the first token the turn's
whole remaining budget is begun at once (``begin(ahead)``: the engine runs the steps on its own), so the
next step starts before a token is detokenized and sent; EOS ends the turn; a stop string or a cancel
closes the sequence with steps pending; logprobs belong to the token sent; a chat session's sequence is
split too (its ``reuse`` waits for the steps begun)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from services.common.logprobs import SampledLogprobs
from services.common.sampling import SamplingParams
from services.worker.runner import run_sequence
from services.worker.stats import WorkerCounters
from services.worker.types import FinishReason, GenerationRequest, TokenEvent
from tests.unit.worker.fakes import EOS, FakeEngine, FakeSequence


class SplitSequence(FakeSequence):
    """A FakeSequence whose steps can be begun and waited for; records the order of calls."""

    def __init__(self, engine: SplitEngine, sampling: SamplingParams) -> None:
        super().__init__(engine, sampling)
        self.log = engine.log
        self._owed = 0  # steps begun and not waited for
        self.last_logprobs: SampledLogprobs | None = None

    def begin(self, ahead: int = 0) -> None:
        self.log.append(f"begin {ahead}")
        self._owed = 1 + ahead

    def wait(self) -> int:
        self.log.append("wait")
        assert self._owed > 0, "waited for a step never begun"
        self._owed -= 1
        token = super().step()
        if token == EOS:
            self._owed = 0  # as BatchedSequence.deliver: nothing is begun after EOS
        self.last_logprobs = SampledLogprobs(token_id=token, logprob=-float(token))
        return token

    def step(self) -> int:
        self.begin()
        return self.wait()

    def close(self) -> None:
        self.log.append("close" if self._owed == 0 else "close pending")
        super().close()


class SplitEngine(FakeEngine):
    def __init__(self, script: Sequence[int] | str, **kwargs: object) -> None:
        super().__init__(script, **kwargs)  # type: ignore[arg-type]
        self.log: list[str] = []
        self.seqs: list[SplitSequence] = []

    def start(self, token_ids: Sequence[int], sampling: SamplingParams, replay: Sequence[int] = ()) -> SplitSequence:
        self.started.append(([*token_ids, *replay], sampling))
        seq = SplitSequence(self, sampling)
        self.seqs.append(seq)
        return seq


def run(engine: SplitEngine, sampling: SamplingParams, stop: threading.Event | None = None) -> tuple[str, object]:
    emitted: list[TokenEvent] = []

    def emit(event: TokenEvent) -> None:
        engine.log.append("emit")
        emitted.append(event)

    final = run_sequence(engine, GenerationRequest((1,), sampling), stop or threading.Event(), emit, WorkerCounters())
    return "".join(e.text for e in emitted) + final.text, final


def test_the_next_step_begins_before_the_token_is_sent() -> None:
    engine = SplitEngine("hello world", loop=True)
    text, final = run(engine, SamplingParams(max_tokens=3))
    assert text == "hello worldhello" and final.reason == FinishReason.LENGTH  # type: ignore[attr-defined]
    # step 1 (begin+wait), then the rest of the budget at once, before the first token is emitted
    assert engine.log == ["begin 0", "wait", "begin 1", "emit", "wait", "emit", "wait", "emit", "close"]
    assert engine.steps == 3


def test_eos_ends_the_steps_begun() -> None:
    engine = SplitEngine([*FakeEngine("hello").script, EOS], loop=False)
    _, final = run(engine, SamplingParams(max_tokens=10))
    assert final.reason == FinishReason.STOP  # type: ignore[attr-defined]
    assert engine.steps == 2 and engine.log[-1] == "close"


def test_a_stop_string_closes_the_sequence_with_its_step_pending() -> None:
    engine = SplitEngine("hello world", loop=True)
    text, final = run(engine, SamplingParams(max_tokens=10, stop=("wor",)))
    assert text == "hello " and final.reason == FinishReason.STOP_STRING  # type: ignore[attr-defined]
    assert engine.log[-1] == "close pending" and engine.seqs[0].closed


def test_a_cancel_closes_the_sequence_with_its_step_pending() -> None:
    engine = SplitEngine("hello world", loop=True)
    stop = threading.Event()

    def emit(event: TokenEvent) -> None:
        stop.set()  # the caller leaves after the first token

    final = run_sequence(engine, GenerationRequest((1,), SamplingParams(max_tokens=10)), stop, emit, WorkerCounters())
    assert final.reason == FinishReason.CANCELLED and final.completion_tokens == 1
    assert engine.log[-1] == "close pending"


def test_logprobs_are_those_of_the_token_sent() -> None:
    engine = SplitEngine("hello world", loop=True)
    emitted: list[TokenEvent] = []
    sampling = SamplingParams(max_tokens=4, logprobs=True)
    run_sequence(engine, GenerationRequest((1,), sampling), threading.Event(), emitted.append, WorkerCounters())
    assert [e.logprobs[0].logprob for e in emitted] == [-float(e.token_ids[0]) for e in emitted]  # type: ignore[index]


def test_a_chat_session_sequence_is_split_too() -> None:
    from services.worker.sessions import ChatSession, ChatSessions

    engine = SplitEngine("hello world", loop=True)
    session = ChatSession(ChatSessions(4, 60.0))
    final = run_sequence(
        engine, GenerationRequest((1,), SamplingParams(max_tokens=3)), threading.Event(), lambda e: None,
        WorkerCounters(), session,
    )  # fmt: skip
    assert final.completion_tokens == 3
    assert engine.log == ["begin 0", "wait", "begin 1", "wait", "wait", "close"]
