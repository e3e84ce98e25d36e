"""A scripted batched engine and a byte-level tokenizer for testing the worker runtime without a model."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.common.generation import Final, FinishReason, GenerationEvent
from services.common.sampling import SamplingParams
from services.worker.detokenizer import IncrementalDetokenizer
from services.worker.stops import StopStringMatcher
from services.worker.types import Engine, EngineCapabilities, EngineInfo, NewSequence, SequenceOutput

EOS = 0


class ByteTokenizer:
    """Token i decodes to ``vocab[i]`` (bytes), so multi-byte characters can span tokens."""

    def __init__(self, vocab: Sequence[bytes]) -> None:
        self.vocab = list(vocab)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.vocab[i] for i in ids if i != EOS).decode("utf-8", errors="replace")

    def encode(self, text: str) -> list[int]:
        """Greedy longest-match encoding (test convenience)."""
        data, ids = text.encode(), []
        while data:
            i = max((i for i, v in enumerate(self.vocab) if v and data.startswith(v)), key=lambda i: len(self.vocab[i]))
            ids.append(i)
            data = data[len(self.vocab[i]) :]
        return ids


VOCAB = [b"<eos>", *(bytes([c]) for c in b" abcdefghijklmnopqrstuvwxyz.,!"), b"hello", b" world", b"\xc3", b"\xa9"]
TOKENIZER = ByteTokenizer(VOCAB)


@dataclass(eq=False)
class FakeSequence:
    seq: NewSequence
    tokens: list[int]
    """Prompt, replay, then what it generated."""
    pos: int = 0
    generated: int = 0
    prefill_left: int = 0
    """Steps its prefill still takes before the first token (``FakeEngine.prefill_steps``)."""
    prefill_tokens: int = 0
    held: bool = False
    log: list[str] = field(default_factory=list)


class FakeEngine(Engine):
    """Every live sequence advances one scripted token per step (repeating the script if ``loop``;
    else its last token forever).

    ``gate``: a semaphore each step acquires once (lets a test hold the engine mid-generation).
    ``step_s``: blocking sleep per step, like a model call. ``prefill_steps``: steps a sequence's
    prefill takes before its first token. ``chat``/``forks``: the capabilities it declares.
    """

    def __init__(
        self,
        script: Sequence[int] | str = "hello world",
        *,
        loop: bool = True,
        context_length: int = 64,
        step_s: float = 0.0,
        chat: bool = False,
        forks: bool = False,
        prefill_steps: int = 0,
    ) -> None:
        self.script = TOKENIZER.encode(script) if isinstance(script, str) else list(script)
        self.loop = loop
        self.step_s = step_s
        self.prefill_steps = prefill_steps
        self.gate: threading.Semaphore | None = None
        self.steps = 0
        """Sequence rows stepped so far (a step of three sequences counts three)."""
        self.calls = 0
        """``step()`` calls so far."""
        self.started: list[tuple[list[int], SamplingParams]] = []
        self.added: list[NewSequence] = []
        self.stopped: list[int] = []
        self.live: dict[int, FakeSequence] = {}
        self.held: dict[int, FakeSequence] = {}
        self._info = EngineInfo("fake-model", len(VOCAB), context_length, frozenset({EOS}))
        self._caps = EngineCapabilities("fake", chat=chat, forks=forks, logprobs=False, penalties=True)

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def tokenizer(self) -> ByteTokenizer:
        return TOKENIZER

    @property
    def capabilities(self) -> EngineCapabilities:
        return self._caps

    def add(self, seq: NewSequence) -> None:
        context = [*seq.prompt_ids, *seq.replay]
        self.started.append((list(context), seq.sampling))
        self.added.append(seq)
        previous = self.held.pop(seq.reuse, None) if seq.reuse is not None else None
        fake = FakeSequence(seq, context, prefill_left=self.prefill_steps, prefill_tokens=len(context))
        if previous is not None:  # a chat's next turn: the common prefix is reused
            common = 0
            while (
                common < min(len(previous.tokens) - 1, len(context) - 1) and previous.tokens[common] == context[common]
            ):
                common += 1
            fake.prefill_tokens = len(context) - common
            fake.pos = previous.pos
        self.live[seq.id] = fake

    def stop(self, seq_id: int, hold: bool = False) -> None:
        self.stopped.append(seq_id)
        fake = self.live.pop(seq_id, None) or self.held.pop(seq_id, None)
        if fake is not None and hold and fake.seq.hold:
            self.held[seq_id] = fake

    def next_step_in(self) -> float | None:
        return 0.0 if self.live else None

    def step(self) -> list[SequenceOutput]:
        if self.gate is not None:
            self.gate.acquire()
        if self.step_s:
            time.sleep(self.step_s)  # simulates blocking model work
        self.calls += 1
        outputs = []
        for fake in list(self.live.values()):
            self.steps += 1
            if fake.prefill_left:
                fake.prefill_left -= 1
                continue
            sampling = fake.seq.sampling
            script = self.script
            if sampling.seed is not None and not sampling.greedy:
                token = 1 + (sampling.seed + fake.pos) % 26
            else:
                token = script[fake.pos % len(script)] if self.loop else script[min(fake.pos, len(script) - 1)]
            fake.pos += 1
            fake.generated += 1
            fake.tokens.append(token)
            out = SequenceOutput(fake.seq.id, [token])
            if fake.generated == 1:
                out.prefill_tokens = fake.prefill_tokens
            if token == EOS:
                out.finish = FinishReason.STOP
            elif fake.generated >= sampling.max_tokens:
                out.finish = FinishReason.LENGTH
            if out.finish is not None:
                del self.live[fake.seq.id]
                if fake.seq.hold:
                    self.held[fake.seq.id] = fake
            outputs.append(out)
        return outputs


def reference_events(
    script: Sequence[int] | str,
    prompt: Sequence[int],
    sampling: SamplingParams,
    *,
    loop: bool = True,
) -> tuple[list[GenerationEvent], GenerationEvent]:
    """The events of a turn of :class:`FakeEngine` one per token, computed without the runtime (the
    detokenizer and the stop matcher over the scripted tokens): the reference runtime tests compare
    against. Returns the token events and the final one."""
    ids = TOKENIZER.encode(script) if isinstance(script, str) else list(script)
    detok = IncrementalDetokenizer(TOKENIZER, prompt)
    stops = StopStringMatcher(sampling.stop)
    events: list[GenerationEvent] = []
    reason = FinishReason.LENGTH
    produced = 0
    for pos in range(sampling.max_tokens):
        token = ids[pos % len(ids)] if loop else ids[min(pos, len(ids) - 1)]
        produced += 1
        if token == EOS:
            reason = FinishReason.STOP
            break
        text, stopped = stops.feed(detok.add(token))
        events.append(GenerationEvent((token,), text))
        if stopped:
            reason = FinishReason.STOP_STRING
            break
    tail = ""
    if reason is not FinishReason.STOP_STRING:
        tail, stopped = stops.feed(detok.flush())
        if stopped:
            reason = FinishReason.STOP_STRING
        else:
            tail += stops.flush()
    final = GenerationEvent(text=tail, final=Final(reason, len(prompt), produced, len(prompt)))
    return events, final


class SleepyEngine(FakeEngine):
    """A scripted engine that declares sleep; ``gate`` (when set) holds each restore until released."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self._caps = EngineCapabilities("fake", chat=self._caps.chat, penalties=True, sleeps=True)
        self.released = 0
        self.restored = 0
        self.loaded = True
        self.restore_gate: threading.Event | None = None
        self.restore_error: BaseException | None = None

    def release_model(self) -> None:
        assert not self.live, "released with live sequences"
        self.held.clear()
        self.loaded = False
        self.released += 1

    def restore_model(self) -> None:
        if self.restore_gate is not None:
            assert self.restore_gate.wait(10)
        if self.restore_error is not None:
            raise self.restore_error
        self.loaded = True
        self.restored += 1

    def step(self):  # type: ignore[no-untyped-def]
        assert self.loaded, "stepped while released"
        return super().step()
