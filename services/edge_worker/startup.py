"""Edge worker wiring: the generic Worker servicer over a :class:`BatchedEngine` (or :class:`OgEngine`)."""

from __future__ import annotations

import asyncio

from services.edge_worker.batched import BatchedEngine
from services.edge_worker.config import EdgeWorkerSettings
from services.edge_worker.engine import OgEngine
from services.worker.app import RunningWorker, start_worker

TIER = "edge"


def build_engine(settings: EdgeWorkerSettings) -> BatchedEngine | OgEngine:
    """Load the model named by the settings (blocking: seconds)."""
    if settings.engine == "og":
        return OgEngine(
            settings.check_model(),
            model_id=settings.model_id,
            threads=settings.threads,
            chat_reserve_tokens=settings.chat_reserve_tokens,
        )
    return BatchedEngine(
        settings.check_model(),
        model_id=settings.model_id,
        threads=settings.threads,
        max_batch=settings.max_active_sequences,
        max_wait_s=settings.batch_wait_ms / 1000,
        prefill_chunk=settings.prefill_chunk_tokens,
        batch_invariant=settings.batch_invariant,
        lm_head=settings.lm_head,
        spinning=settings.intra_op_spinning,
        adaptive_threading=settings.adaptive_threading,
        adaptive_max_rows=settings.adaptive_max_rows,
        load_cache_dir=settings.resolved_load_cache_dir(),
        max_hold_s=settings.background_max_hold_s,
    )


async def start_edge_worker(
    settings: EdgeWorkerSettings, engine: BatchedEngine | OgEngine | None = None
) -> RunningWorker:
    """Serve an edge worker in this process; loads the model in a thread unless ``engine`` is given."""
    if engine is None:
        engine = await asyncio.to_thread(build_engine, settings)
    return await start_worker(settings, engine, tier=TIER)
