"""Cloud worker wiring: the generic Worker servicer over a :class:`TorchEngine`."""

from __future__ import annotations

import asyncio

from services.common.worker.app import RunningWorker, start_worker
from services.gpu_worker.config import GpuWorkerSettings
from services.gpu_worker.engine import TorchEngine

TIER = "cloud"


def build_engine(settings: GpuWorkerSettings) -> TorchEngine:
    """Load the model named by the settings (blocking: seconds)."""
    return TorchEngine(
        settings.check_model(),
        model_id=settings.model_id,
        device=settings.device,
        dtype=settings.dtype,
        threads=settings.threads,
    )


async def start_gpu_worker(settings: GpuWorkerSettings, engine: TorchEngine | None = None) -> RunningWorker:
    """Serve a cloud worker in this process; loads the model in a thread unless ``engine`` is given."""
    if engine is None:
        engine = await asyncio.to_thread(build_engine, settings)
    return await start_worker(settings, engine, tier=TIER)
