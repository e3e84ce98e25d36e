"""``python -m services.gateway.http``: the OpenAI-compatible HTTP adapter behind Envoy.

Only parses the settings and calls :func:`services.gateway.http.server.run`."""

from __future__ import annotations

import asyncio
import sys

from services.common.config import load_settings
from services.common.errors import ConfigError
from services.common.logging import configure_logging
from services.gateway.http.config import HttpAdapterSettings
from services.gateway.http.server import run


def main() -> int:
    try:
        settings = load_settings(HttpAdapterSettings)
        configure_logging("gateway_http", settings.log_level, settings.log_json)
        asyncio.run(run(settings))
    except ConfigError as exc:
        print(f"gateway_http: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
