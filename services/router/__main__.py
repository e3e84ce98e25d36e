"""``python -m services.router``: configured by MESHSERVE_ROUTER_* env vars (see config.py)."""

from __future__ import annotations

import asyncio
import sys

from services.common.config import load_settings
from services.common.errors import ConfigError
from services.common.logging import configure_logging
from services.router.config import RouterSettings
from services.router.server import start_router


async def _main() -> None:
    settings = load_settings(RouterSettings)
    configure_logging("router", settings.log_level, settings.log_json)
    server, _router = await start_router(settings)
    await server.serve_until_signal()


def main() -> None:
    try:
        asyncio.run(_main())
    except ConfigError as exc:
        print(f"router: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
