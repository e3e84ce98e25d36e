"""A real worker process (services/worker runtime) over a synthetic engine: tokens at once or paced.

``python -m benchmarks.gateway.instant_worker`` (settings ``MESHSERVE_INSTANT_WORKER_*``, the usual worker
settings): the same admission, engine loop, detokenizer, stop strings, servicer and interceptors
as the edge and cloud workers, but ``step()`` costs no model time, so what a benchmark measures
through it is the transport and the services, not matrix multiplies. Output is deterministic: the
continuation of a prompt is a fixed function of its token ids (real SmolLM2 token ids, decoded by the
real tokenizer), so cache keys and texts look like real traffic.

``MESHSERVE_INSTANT_WORKER_TOKEN_INTERVAL_MS`` paces the steps to one per interval (a decode step's
rhythm, without its compute), so a relay sees tokens arrive one at a time as from a real model.

Used by :mod:`benchmarks.gateway.hops` and :mod:`benchmarks.gateway.relay` to resolve the sub-millisecond cost of the
gateway and router hops.
"""

from __future__ import annotations

import time
from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.common.generation import FinishReason
from services.common.model_paths import model_paths
from services.common.tokenizer import Tokenizer
from services.worker.config import WorkerSettings
from services.worker.server import run_worker_process
from services.worker.types import Engine, EngineCapabilities, EngineInfo, NewSequence, SequenceOutput

# Ordinary word-piece ids of SmolLM2's vocabulary (ASCII words), cycled through deterministically.
_WORDS = tuple(range(1000, 1256))


class InstantWorkerSettings(WorkerSettings):
    """Worker settings under ``MESHSERVE_INSTANT_WORKER_``; no model options."""

    service: ClassVar[str] = "instant_worker"
    model_config = SettingsConfigDict(env_prefix="MESHSERVE_INSTANT_WORKER_", extra="ignore")

    # 0: tokens at once; > 0: each sequence emits one token per interval, like one decode step each.
    token_interval_ms: float = Field(default=0.0, ge=0.0, le=10_000.0)


class InstantEngine(Engine):
    """Never emits EOS: every turn runs to ``max_tokens`` (or a stop string), with no model time.

    A batched engine as the real ones are: each step advances every live sequence by one token; with
    a token interval a step waits until the interval since the previous one has passed (a decode
    step's rhythm, without its compute).
    """

    def __init__(
        self, tokenizer: Tokenizer, model_id: str, context_length: int = 8192, token_interval_ms: float = 0.0
    ) -> None:
        self._tokenizer = tokenizer
        self._interval_s = token_interval_ms / 1000.0
        self._due = 0.0
        self._info = EngineInfo(model_id, tokenizer.vocab_size, context_length, frozenset())
        self._caps = EngineCapabilities("instant")
        self._live: dict[int, list[int]] = {}  # id -> [position, generated, max_tokens]
        self._new: set[int] = set()

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def capabilities(self) -> EngineCapabilities:
        return self._caps

    def add(self, seq: NewSequence) -> None:
        self._live[seq.id] = [sum(seq.prompt_ids) % len(_WORDS) + len(seq.replay), 0, seq.sampling.max_tokens]
        self._new.add(seq.id)

    def stop(self, seq_id: int, hold: bool = False) -> None:
        self._live.pop(seq_id, None)

    def next_step_in(self) -> float | None:
        if not self._live:
            return None
        return max(0.0, self._due - time.monotonic()) if self._interval_s else 0.0

    def step(self) -> list[SequenceOutput]:
        if self._interval_s:
            self._due = max(self._due, time.monotonic()) + self._interval_s
        outputs = []
        ended = []
        new, self._new = self._new, set()
        for seq_id, state in self._live.items():
            token = _WORDS[state[0] % len(_WORDS)]
            state[0] += 1
            state[1] += 1
            out = SequenceOutput(seq_id, [token])
            if seq_id in new:
                out.prefill_tokens = 1
            if state[1] >= state[2]:
                out.finish = FinishReason.LENGTH
                ended.append(seq_id)
            outputs.append(out)
        for seq_id in ended:
            del self._live[seq_id]
        return outputs


def build_engine(settings: InstantWorkerSettings) -> InstantEngine:
    tokenizer = Tokenizer(model_paths(settings.model_id).hf_dir)
    return InstantEngine(tokenizer, settings.model_id, token_interval_ms=settings.token_interval_ms)


def main() -> None:
    run_worker_process(InstantWorkerSettings, build_engine, tier="edge")


if __name__ == "__main__":
    main()
