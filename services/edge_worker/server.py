"""Edge worker wiring: the generic Worker servicer over a :class:`OrtEngine` (or :class:`OgEngine`)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import structlog

from services.common.errors import ConfigError
from services.edge_worker.config import EdgeWorkerSettings
from services.edge_worker.native.kernel import KernelUnavailable, compile_kernel
from services.edge_worker.ort_engine import OrtEngine
from services.worker.server import RunningWorker, start_worker

if TYPE_CHECKING:
    from services.edge_worker.og_engine import OgEngine

TIER = "edge"

log = structlog.get_logger(__name__)


def int4_kernel(settings: EdgeWorkerSettings) -> str:
    """The int4 kernel the engine runs (``mlas`` or ``native``): the setting, with ``auto`` resolved
    (native when it builds and runs here, else mlas, logged with the reason); ConfigError (one sentence)
    when ``native`` is asked for and cannot run here. Compiles the kernel once per version (seconds)."""
    wanted = settings.int4_kernel
    if wanted == "mlas" or (wanted == "auto" and settings.adaptive_threading):
        return "mlas"
    try:
        compile_kernel()  # once per kernel version; the engine then loads it from the cache
    except KernelUnavailable as exc:
        if wanted == "auto":
            log.warning("edge_int4_kernel_fallback", kernel="mlas", reason=str(exc))
            return "mlas"
        raise ConfigError(
            f"MESHSERVE_EDGE_WORKER_INT4_KERNEL=native cannot run on this machine: {exc} "
            "Set it to mlas or auto to use onnxruntime's kernels."
        ) from None
    return "native"


def build_engine(settings: EdgeWorkerSettings) -> OrtEngine | OgEngine:
    """Load the model named by the settings (blocking: seconds); ConfigError (one sentence) when
    ``int4_kernel=native`` cannot be built or run here (:func:`int4_kernel`)."""
    if settings.engine == "og":
        from services.edge_worker.og_engine import OgEngine  # onnxruntime-genai: only for this engine

        return OgEngine(
            settings.check_model(),
            model_id=settings.model_id,
            threads=settings.threads,
            chat_reserve_tokens=settings.chat_reserve_tokens,
        )
    kernel = int4_kernel(settings)
    return OrtEngine(
        settings.check_model(),
        model_id=settings.model_id,
        threads=settings.threads,
        max_batch=settings.max_active_sequences,
        prefill_chunk=settings.prefill_chunk_tokens,
        batch_invariant=settings.batch_invariant,
        lm_head=settings.lm_head,
        int4_kernel=kernel,
        # adaptive threading: its sessions set their own spinning, as before the bounded default
        spinning=settings.intra_op_spinning and not settings.adaptive_threading,
        spin_us=0 if settings.adaptive_threading else settings.intra_op_spin_us,
        adaptive_threading=settings.adaptive_threading,
        adaptive_max_rows=settings.adaptive_max_rows,
        load_cache_dir=settings.resolved_load_cache_dir(),
        max_hold_s=settings.background_max_hold_s,
    )


async def start_edge_worker(settings: EdgeWorkerSettings, engine: OrtEngine | OgEngine | None = None) -> RunningWorker:
    """Serve an edge worker in this process; loads the model in a thread unless ``engine`` is given."""
    if engine is None:
        engine = await asyncio.to_thread(build_engine, settings)
    return await start_worker(settings, engine, tier=TIER)
