"""``python -m services.gateway``: the public gateway process (settings from MESHSERVE_GATEWAY_*)."""

from __future__ import annotations

import asyncio
import sys

import grpc
import structlog

from services.common.errors import ConfigError
from services.common.logging import configure_logging
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.serving import MAX_MESSAGE_BYTES, RunningServer, start_server
from services.common.settings import load_settings
from services.gateway.auth import ApiKeyAuthenticator, parse_api_keys
from services.gateway.config import GatewaySettings
from services.gateway.servicer import SERVICE_NAME, GatewayServicer

log = structlog.get_logger(__name__)


async def serve(settings: GatewaySettings) -> RunningServer:
    """Start the gateway (health SERVING once bound) and return it; ``stop()`` also closes the router channel."""
    keys = parse_api_keys(settings.api_keys)
    if not keys:
        raise ConfigError(
            "no API keys configured: set MESHSERVE_GATEWAY_API_KEYS to comma-separated tenant:sha256hex entries"
        )
    channel = grpc.aio.insecure_channel(
        settings.router_address,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    servicer = GatewayServicer(settings, ApiKeyAuthenticator(keys), inference_pb2_grpc.InferenceStub(channel))
    try:
        running = await start_server(
            settings,
            register=lambda server: inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server),
            service_names=[SERVICE_NAME],
        )
    except BaseException:
        await channel.close()
        raise
    running.on_stop.append(channel.close)
    log.info("gateway_ready", router=settings.router_address, tenants=len({k.tenant for k in keys}))
    return running


async def _main(settings: GatewaySettings) -> None:
    running = await serve(settings)
    await running.serve_until_signal()


def main() -> int:
    try:
        settings = load_settings(GatewaySettings)
        configure_logging("gateway", settings.log_level, settings.log_json)
        asyncio.run(_main(settings))
    except ConfigError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
