"""Cloud worker wiring: the generic Worker servicer over a :class:`CloudEngine`."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import structlog

from services.gpu_worker.config import GpuWorkerSettings
from services.gpu_worker.engine import CloudEngine
from services.gpu_worker.prefix import RedisPrefixCache
from services.gpu_worker.speculative import load_draft_model
from services.gpu_worker.tp import start_leader
from services.worker.server import RunningWorker, start_worker

TIER = "cloud"
log = structlog.get_logger(__name__)


def build_engine(settings: GpuWorkerSettings) -> CloudEngine:
    """Load the model named by the settings (blocking: seconds)."""
    redis = None
    if settings.redis_url and settings.prefix_cache:
        redis = RedisPrefixCache(
            settings.redis_url,
            block_tokens=settings.prefix_block_tokens,
            budget_bytes=settings.kv_redis_budget_bytes,
            ttl_s=settings.kv_redis_ttl_s,
            timeout_s=settings.kv_redis_timeout_s,
            max_block_bytes=64 << 20,
        )
    leader = start_leader(settings)  # rank 0 of a torchrun group of > 1 ranks (tp.py); else None
    tp_hooks: dict[str, Any] = {}
    if leader is not None:
        tp_hooks = {
            "shard": leader.shard,
            "all_reduce": leader.all_reduce,
            "wrap_forward": leader.wrap_forward,
            "kv_io": leader,  # Redis prefix blocks: gathered / scattered over the group (tp_kv.py)
            "group": leader,  # followers share each cache the engine builds, and sleep and wake with it
        }
    engine = CloudEngine(
        settings.check_model(),
        model_id=settings.model_id,
        model_version=settings.resolved_model_version(),
        device=settings.device,
        dtype=settings.dtype,
        kv_dtype=settings.kv_dtype,
        threads=settings.threads,
        cpu_primitive_cache=settings.cpu_primitive_cache,
        kv_budget_bytes=settings.kv_budget_bytes,
        block_tokens=settings.prefix_block_tokens,
        max_step_tokens=settings.max_step_tokens,
        prefix_cache=settings.prefix_cache,
        redis=redis,
        allow_download=settings.allow_download,
        decode_graphs=settings.decode_graphs,
        max_batch=settings.max_active_sequences,
        load_cache_dir=settings.resolved_load_cache_dir(),
        **tp_hooks,
    )
    if settings.speculative:
        draft_dir = Path(settings.resolved_draft_model())
        log.info("speculative_draft_loading", draft=str(draft_dir), default=not settings.draft_model)
        draft = load_draft_model(draft_dir, threads=settings.threads or 1)
        engine.speculate(draft, k_max=settings.speculative_k_max)
    return engine


async def start_gpu_worker(settings: GpuWorkerSettings, engine: CloudEngine | None = None) -> RunningWorker:
    """Serve a cloud worker in this process; loads the model in a thread unless ``engine`` is given."""
    if engine is None:
        engine = await asyncio.to_thread(build_engine, settings)
    worker = await start_worker(settings, engine, tier=TIER)

    async def close_engine() -> None:
        await asyncio.to_thread(engine.close)

    worker.server.on_stop.append(close_engine)
    return worker
