"""The HTTP adapter process patches grpc.aio's stream write (grpc#36066) before it opens its channel:
the adapter is not a gRPC server, so start_server's patch never ran in it, and a 401 from the gateway
racing the adapter's Chat write came out as HTTP 500 (fuzz, docs/fuzz.md)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import asyncio
from grpc.aio import _call
from services.common import grpc_compat
from services.gateway.http.server import serve
from services.gateway.http.config import HttpAdapterSettings
from services.common.config import load_settings

async def main():
    assert _call._StreamRequestMixin._write is not grpc_compat._write, "patched before serve()?"
    settings = load_settings(HttpAdapterSettings, host="127.0.0.1", port=0, gateway_address="127.0.0.1:1")
    runner, _port, channel = await serve(settings)
    try:
        assert _call._StreamRequestMixin._write is grpc_compat._write
    finally:
        await runner.cleanup()
        await channel.close()
    print("patched")

asyncio.run(main())
"""


def test_the_adapter_process_patches_grpc_aio_before_serving() -> None:
    # A fresh interpreter: this test process may already be patched by servers other tests started.
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("patched")
