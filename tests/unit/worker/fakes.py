"""A scripted engine and a byte-level tokenizer for testing the worker runtime without a model."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from services.common.sampling import SamplingParams
from services.worker.types import EngineInfo

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


class FakeSequence:
    def __init__(self, engine: FakeEngine, sampling: SamplingParams) -> None:
        self._engine = engine
        self._sampling = sampling
        self._pos = 0
        self.closed = False

    def step(self) -> int:
        engine = self._engine
        if engine.gate is not None:
            engine.gate.acquire()
        if engine.step_s:
            time.sleep(engine.step_s)  # simulates blocking model work
        with engine.lock:
            engine.steps += 1
        script = engine.script
        token = script[self._pos % len(script)] if engine.loop else script[min(self._pos, len(script) - 1)]
        if self._sampling.seed is not None and not self._sampling.greedy:
            token = 1 + (self._sampling.seed + self._pos) % 26
        self._pos += 1
        return token

    def close(self) -> None:
        self.closed = True


class FakeEngine:
    """Returns ``script`` token by token (repeating if ``loop``; else the last one forever).

    ``gate``: a semaphore each step acquires (lets a test hold the engine mid-generation).
    ``step_s``: blocking sleep per step, to check the event loop is never blocked.
    """

    def __init__(
        self,
        script: Sequence[int] | str = "hello world",
        *,
        loop: bool = True,
        context_length: int = 64,
        step_s: float = 0.0,
    ) -> None:
        self.script = TOKENIZER.encode(script) if isinstance(script, str) else list(script)
        self.loop = loop
        self.step_s = step_s
        self.gate: threading.Semaphore | None = None
        self.lock = threading.Lock()
        self.steps = 0
        self.started: list[tuple[list[int], SamplingParams]] = []
        self._info = EngineInfo("fake-model", len(VOCAB), context_length, frozenset({EOS}))

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def tokenizer(self) -> ByteTokenizer:
        return TOKENIZER

    def start(self, token_ids: Sequence[int], sampling: SamplingParams, replay: Sequence[int] = ()) -> FakeSequence:
        self.started.append(([*token_ids, *replay], sampling))
        return FakeSequence(self, sampling)
