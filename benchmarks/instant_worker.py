"""A real worker process (services/common/worker runtime) over a synthetic engine that emits tokens at once.

``python -m benchmarks.instant_worker`` (settings ``MESHSERVE_INSTANT_WORKER_*``, the usual worker
settings): the same admission, runner threads, detokenizer, stop strings, servicer and interceptors
as the edge and cloud workers, but ``step()`` costs no model time, so what a benchmark measures
through it is the transport and the services, not matrix multiplies. Output is deterministic: the
continuation of a prompt is a fixed function of its token ids (real SmolLM2 token ids, decoded by the
real tokenizer), so cache keys and texts look like real traffic.

Used by :mod:`benchmarks.hops` to resolve the sub-millisecond cost of the gateway and router hops.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from pydantic_settings import SettingsConfigDict

from services.common.tokenizer import Tokenizer
from services.common.worker.app import run_worker_process
from services.common.worker.settings import WorkerSettings
from services.common.worker.types import EngineInfo, SamplingConfig
from services.models.paths import model_paths

# Ordinary word-piece ids of SmolLM2's vocabulary (ASCII words), cycled through deterministically.
_WORDS = tuple(range(1000, 1256))


class InstantWorkerSettings(WorkerSettings):
    """Worker settings under ``MESHSERVE_INSTANT_WORKER_``; no model options."""

    service: ClassVar[str] = "instant_worker"
    model_config = SettingsConfigDict(env_prefix="MESHSERVE_INSTANT_WORKER_", extra="ignore")


class _Sequence:
    def __init__(self, seed: int, replay: int) -> None:
        self._pos = seed + replay

    def step(self) -> int:
        token = _WORDS[self._pos % len(_WORDS)]
        self._pos += 1
        return token

    def close(self) -> None:
        pass


class InstantEngine:
    """Never emits EOS: every turn runs to ``max_tokens`` (or a stop string), with no model time."""

    def __init__(self, tokenizer: Tokenizer, model_id: str, context_length: int = 8192) -> None:
        self._tokenizer = tokenizer
        self._info = EngineInfo(model_id, tokenizer.vocab_size, context_length, frozenset())

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def start(self, token_ids: Sequence[int], sampling: SamplingConfig, replay: Sequence[int] = ()) -> _Sequence:
        return _Sequence(sum(token_ids) % len(_WORDS), len(replay))


def build_engine(settings: InstantWorkerSettings) -> InstantEngine:
    return InstantEngine(Tokenizer(model_paths(settings.model_id).hf_dir), settings.model_id)


def main() -> None:
    run_worker_process(InstantWorkerSettings, build_engine, tier="edge")


if __name__ == "__main__":
    main()
