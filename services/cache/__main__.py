"""``python -m services.cache``: the cache admin service (settings from MESHSERVE_CACHE_*)."""

from __future__ import annotations

import asyncio
import sys

from services.cache.config import CacheSettings
from services.cache.server import start_cache_service
from services.common.config import load_settings
from services.common.errors import ConfigError
from services.common.logging import configure_logging


async def _main() -> None:
    settings = load_settings(CacheSettings)
    configure_logging("cache", settings.log_level, settings.log_json)
    server = await start_cache_service(settings)
    await server.serve_until_signal()


def main() -> None:
    try:
        asyncio.run(_main())
    except ConfigError as exc:
        print(f"cache: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
