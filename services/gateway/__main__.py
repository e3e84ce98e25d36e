"""``python -m services.gateway``: the public gateway process (settings from MESHSERVE_GATEWAY_*).

Only parses the settings and calls :func:`services.gateway.server.run`."""

from __future__ import annotations

import asyncio
import sys

from services.common.config import load_settings
from services.common.errors import ConfigError
from services.common.logging import configure_logging
from services.gateway.config import GatewaySettings
from services.gateway.server import run


def main() -> int:
    try:
        settings = load_settings(GatewaySettings)
        configure_logging("gateway", settings.log_level, settings.log_json)
        asyncio.run(run(settings))
    except ConfigError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
