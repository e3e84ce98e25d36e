"""``python -m services.batch``: one batch runner (settings from MESHSERVE_BATCH_*).

Only parses the settings and calls :func:`services.batch.server.run`."""

from __future__ import annotations

import asyncio
import sys

from services.batch.config import BatchSettings
from services.batch.server import run
from services.common.config import load_settings
from services.common.errors import ConfigError
from services.common.logging import configure_logging


def main() -> int:
    try:
        settings = load_settings(BatchSettings)
        configure_logging("batch", settings.log_level, settings.log_json)
        asyncio.run(run(settings))
    except ConfigError as exc:
        print(f"batch: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
