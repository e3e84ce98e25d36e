"""``python -m services.gpu_worker``: serve the HF checkpoint with torch until SIGTERM."""

from __future__ import annotations

from services.common.worker.app import run_worker_process
from services.gpu_worker.config import GpuWorkerSettings
from services.gpu_worker.servicer import TIER, build_engine


def main() -> None:
    run_worker_process(GpuWorkerSettings, build_engine, tier=TIER)


if __name__ == "__main__":
    main()
