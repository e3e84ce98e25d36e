"""A worker process of the runtime before the engine loop over :class:`runtime_side.LockstepEngine`:
the old tree's side of ``meshserve bench worker-runtime --service``.

Run as ``python -P benchmarks/worker/lockstep_worker.py`` with ``PYTHONPATH`` = the old tree: its own
worker runtime, servicer and stream transport (``run_worker_process``), with the instant worker's
settings (``MESHSERVE_INSTANT_WORKER_*``), over an engine whose sequences all wait for one shared
zero-cost batch step, as both real engines' did. This tree's side runs its own instant worker
(benchmarks/gateway/instant_worker.py, the same zero-cost engine as a batched engine).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import ClassVar

sys.path.insert(1, str(Path(__file__).resolve().parent))  # runtime_side, beside this file (-P keeps it off)

from pydantic_settings import SettingsConfigDict
from runtime_side import LockstepEngine, _tokenizer

from services.common.model_paths import model_paths
from services.worker.config import WorkerSettings
from services.worker.server import run_worker_process


class LockstepWorkerSettings(WorkerSettings):
    service: ClassVar[str] = "instant_worker"
    model_config = SettingsConfigDict(env_prefix="MESHSERVE_INSTANT_WORKER_", extra="ignore")


def build_engine(settings: LockstepWorkerSettings) -> LockstepEngine:
    return LockstepEngine(_tokenizer(str(model_paths(settings.model_id).hf_dir)), settings.model_id)


if __name__ == "__main__":
    run_worker_process(LockstepWorkerSettings, build_engine, tier="edge")  # type: ignore[arg-type]
