"""``python -m services.edge_worker``: serve the INT4 ONNX model until SIGTERM."""

from __future__ import annotations

from services.edge_worker.config import EdgeWorkerSettings
from services.edge_worker.server import TIER, build_engine
from services.worker.server import run_worker_process


def main() -> None:
    run_worker_process(EdgeWorkerSettings, build_engine, tier=TIER)


if __name__ == "__main__":
    main()
