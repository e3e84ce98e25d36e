"""A real worker process (services/worker runtime) over a synthetic engine: tokens at once or paced.

``python -m benchmarks.gateway.instant_worker`` (settings ``MESHSERVE_INSTANT_WORKER_*``, the usual worker
settings): the same admission, runner threads, detokenizer, stop strings, servicer and interceptors
as the edge and cloud workers, but ``step()`` costs no model time, so what a benchmark measures
through it is the transport and the services, not matrix multiplies. Output is deterministic: the
continuation of a prompt is a fixed function of its token ids (real SmolLM2 token ids, decoded by the
real tokenizer), so cache keys and texts look like real traffic.

``MESHSERVE_INSTANT_WORKER_TOKEN_INTERVAL_MS`` paces each sequence to one token per interval (a decode
step's rhythm, without its compute), so a relay sees tokens arrive one at a time as from a real model.

Used by :mod:`benchmarks.gateway.hops` and :mod:`benchmarks.gateway.relay` to resolve the sub-millisecond cost of the
gateway and router hops.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.common.model_paths import model_paths
from services.common.sampling import SamplingParams
from services.common.tokenizer import Tokenizer
from services.worker.app import run_worker_process
from services.worker.settings import WorkerSettings
from services.worker.types import EngineInfo

# Ordinary word-piece ids of SmolLM2's vocabulary (ASCII words), cycled through deterministically.
_WORDS = tuple(range(1000, 1256))


class InstantWorkerSettings(WorkerSettings):
    """Worker settings under ``MESHSERVE_INSTANT_WORKER_``; no model options."""

    service: ClassVar[str] = "instant_worker"
    model_config = SettingsConfigDict(env_prefix="MESHSERVE_INSTANT_WORKER_", extra="ignore")

    # 0: tokens at once; > 0: each sequence emits one token per interval, like one decode step each.
    token_interval_ms: float = Field(default=0.0, ge=0.0, le=10_000.0)


class _Sequence:
    def __init__(self, seed: int, replay: int, interval_s: float = 0.0) -> None:
        self._pos = seed + replay
        self._interval_s = interval_s
        self._due = time.monotonic()

    def step(self) -> int:
        if self._interval_s:  # runs on the sequence's own runner thread, never the event loop
            delay = self._due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            self._due += self._interval_s
        token = _WORDS[self._pos % len(_WORDS)]
        self._pos += 1
        return token

    def close(self) -> None:
        pass


class InstantEngine:
    """Never emits EOS: every turn runs to ``max_tokens`` (or a stop string), with no model time."""

    def __init__(
        self, tokenizer: Tokenizer, model_id: str, context_length: int = 8192, token_interval_ms: float = 0.0
    ) -> None:
        self._tokenizer = tokenizer
        self._interval_s = token_interval_ms / 1000.0
        self._info = EngineInfo(model_id, tokenizer.vocab_size, context_length, frozenset())

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def start(self, token_ids: Sequence[int], sampling: SamplingParams, replay: Sequence[int] = ()) -> _Sequence:
        return _Sequence(sum(token_ids) % len(_WORDS), len(replay), self._interval_s)


def build_engine(settings: InstantWorkerSettings) -> InstantEngine:
    tokenizer = Tokenizer(model_paths(settings.model_id).hf_dir)
    return InstantEngine(tokenizer, settings.model_id, token_interval_ms=settings.token_interval_ms)


def main() -> None:
    run_worker_process(InstantWorkerSettings, build_engine, tier="edge")


if __name__ == "__main__":
    main()
