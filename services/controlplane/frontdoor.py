"""The front door: Envoy + the OpenAI HTTP adapter(s) + the xDS files that tell Envoy about gateways.

Traffic: client -> Envoy public listener -> (gRPC) gateway cluster, or (HTTP /v1/*) adapter cluster;
adapter -> Envoy internal listener -> gateway cluster. Envoy is the one load balancer in front of
the gateways, so :meth:`FrontDoor.set_gateways` (an EDS update, no restart) moves HTTP and gRPC
traffic alike. ``meshserve up`` starts one with the mesh; tests start one in front of any gateway.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from services.common.processes import LogSink, ServiceProcess, free_port
from services.controlplane.envoy import Envoy, EnvoyConfig
from services.controlplane.xds import GRPC_CLUSTER, HTTP_CLUSTER, FileXds


class FrontDoor:
    """Start with ``async with FrontDoor([...gateway addresses], sink=...) as door:``."""

    def __init__(
        self,
        gateways: Sequence[str],
        sink: LogSink,
        *,
        http_port: int = 0,
        listen_host: str = "127.0.0.1",
        tls_cert: str = "",
        tls_key: str = "",
        adapters: int = 1,
        env: dict[str, str] | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="meshserve-envoy-")
        self.xds = FileXds(Path(self._tmp.name))
        self.xds.endpoints[GRPC_CLUSTER] = list(gateways)
        self.config = EnvoyConfig(
            xds_dir=Path(self._tmp.name),
            listen_port=http_port or free_port(),
            admin_port=free_port(),
            internal_port=free_port(),
            listen_host=listen_host,
            tls_cert=tls_cert,
            tls_key=tls_key,
        )
        self._sink = sink
        self._env = dict(env or {})
        self._timeout_s = timeout_s
        self.adapters = [self._adapter(i) for i in range(adapters)]
        self.envoy = Envoy(self.config, sink)

    def _adapter(self, index: int) -> ServiceProcess:
        env = {
            "MESHSERVE_GATEWAY_HTTP_METRICS_PORT": "0",  # /metrics on a free port (logged), unless set
            **os.environ,
            **self._env,
            "PYTHONUNBUFFERED": "1",
            "MESHSERVE_GATEWAY_HTTP_GATEWAY_ADDRESS": f"127.0.0.1:{self.config.internal_port}",
            "MESHSERVE_GATEWAY_HTTP_PORT": "0",
        }
        argv = [sys.executable, "-m", "services.gateway.http"]
        return ServiceProcess(f"http-{index}", argv, env, self._sink)

    @property
    def port(self) -> int:
        return self.config.listen_port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (``.../v1``), https when TLS is on."""
        scheme = "https" if self.config.tls_cert else "http"
        return f"{scheme}://127.0.0.1:{self.port}/v1"

    async def start(self) -> FrontDoor:
        try:
            await asyncio.gather(*(a.spawn() for a in self.adapters))
            await asyncio.gather(*(a.wait_started(self._timeout_s) for a in self.adapters))
            self.xds.endpoints[HTTP_CLUSTER] = [a.address for a in self.adapters]
            self.xds.write_all()
            await self.envoy.start(self._timeout_s)
            await self.envoy.wait_hosts(HTTP_CLUSTER, set(self.xds.endpoints[HTTP_CLUSTER]), self._timeout_s)
            await self.envoy.wait_hosts(GRPC_CLUSTER, set(self.xds.endpoints[GRPC_CLUSTER]), self._timeout_s)
        except BaseException:
            await self.stop()
            raise
        return self

    async def set_gateways(self, addresses: Sequence[str]) -> None:
        """Publish a new gateway replica set (EDS) and wait until Envoy routes to exactly it."""
        self.xds.set_endpoints(GRPC_CLUSTER, addresses)
        await self.envoy.wait_hosts(GRPC_CLUSTER, set(addresses), self._timeout_s)

    async def stop(self) -> None:
        """Envoy first (stop taking traffic), then the adapters."""
        await self.envoy.stop()
        await asyncio.gather(*(a.stop() for a in self.adapters))
        self._tmp.cleanup()

    async def __aenter__(self) -> FrontDoor:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
