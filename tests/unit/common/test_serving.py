"""start_server: a port it cannot bind is a ConfigError naming the setting (one line from the service's
main, exit 2), not a traceback. Real gRPC servers and a real socket holding the port."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from services.common.errors import ConfigError
from services.common.processes import free_port
from services.common.serving import start_server
from services.gateway.config import GatewaySettings
from services.router.config import RouterSettings


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def _nothing(server: object) -> None:
    return None


async def test_a_busy_grpc_port_names_the_variable_to_change(busy_port: int) -> None:
    settings = GatewaySettings(port=busy_port, shutdown_grace_s=0)
    with pytest.raises(ConfigError) as err:
        await start_server(settings, _nothing, [])
    message = str(err.value)
    assert f"cannot listen on 127.0.0.1:{busy_port}" in message and "MESHSERVE_GATEWAY_PORT" in message
    assert "\n" not in message


async def test_a_busy_metrics_port_names_its_variable_and_stops_the_grpc_server(busy_port: int) -> None:
    grpc_port = free_port()
    settings = RouterSettings(port=grpc_port, metrics_port=busy_port, shutdown_grace_s=0)
    with pytest.raises(
        ConfigError, match=f"cannot serve /metrics on 127.0.0.1:{busy_port}.*MESHSERVE_ROUTER_METRICS_PORT"
    ):
        await start_server(settings, _nothing, [])
    with socket.socket() as again:  # the gRPC server that had started let its port go
        again.bind(("127.0.0.1", grpc_port))
