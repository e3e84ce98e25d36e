"""``python -m services.gpu_worker``: serve the HF checkpoint with torch until SIGTERM.

Under torchrun (``WORLD_SIZE`` > 1) rank 0 serves and the other ranks follow its steps (tp.py).
"""

from __future__ import annotations

from services.gpu_worker.config import GpuWorkerSettings
from services.gpu_worker.server import TIER, build_engine
from services.gpu_worker.tp import RankEnv, follower_main
from services.worker.server import run_worker_process


def main() -> None:
    if RankEnv.from_env().rank > 0:  # a torchrun follower rank: mirrors rank 0's steps (tp.py)
        raise SystemExit(follower_main(GpuWorkerSettings))
    run_worker_process(GpuWorkerSettings, build_engine, tier=TIER)


if __name__ == "__main__":
    main()
