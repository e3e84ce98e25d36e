"""Edge worker wiring: the generic Worker servicer over an :class:`OgEngine`."""

from __future__ import annotations

import asyncio

from services.common.worker.app import RunningWorker, start_worker
from services.edge_worker.config import EdgeWorkerSettings
from services.edge_worker.engine import OgEngine

TIER = "edge"


def build_engine(settings: EdgeWorkerSettings) -> OgEngine:
    """Load the model named by the settings (blocking: seconds)."""
    return OgEngine(
        settings.check_model(),
        model_id=settings.model_id,
        threads=settings.threads,
        chat_reserve_tokens=settings.chat_reserve_tokens,
    )


async def start_edge_worker(settings: EdgeWorkerSettings, engine: OgEngine | None = None) -> RunningWorker:
    """Serve an edge worker in this process; loads the model in a thread unless ``engine`` is given."""
    if engine is None:
        engine = await asyncio.to_thread(build_engine, settings)
    return await start_worker(settings, engine, tier=TIER)
