"""``meshserve frontdoor``: Envoy, the OpenAI HTTP adapter and the control plane as one long-running process.

This is what the ``envoy`` container (docker compose) and the ``frontdoor`` Deployment (Kubernetes)
run: the same :class:`~services.controlplane.frontdoor.FrontDoor` that ``meshserve up`` starts, with
the gateways given as DNS names. Envoy's EDS endpoints must be IP addresses, so the control plane
resolves each name (a compose service with several replicas, or a Kubernetes headless Service,
answers with one address per ready replica) and re-resolves it every ``--resolve-interval`` seconds,
publishing a new EDS file when the replica set changes. Envoy's active gRPC health checks take
replicas that stop serving out of rotation between two resolutions.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import sys
from collections.abc import Sequence

import structlog

from services.common.logging import configure_logging
from services.controlplane.xds import GRPC_CLUSTER

log = structlog.get_logger(__name__)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="meshserve frontdoor", description="Run Envoy + the OpenAI HTTP adapter in front of the gateways."
    )
    p.add_argument(
        "--gateways", required=True, help="comma-separated host:port of the gateways (DNS names are re-resolved)"
    )
    p.add_argument("--http-port", type=int, default=8080, help="Envoy's public port (HTTP/1.1 + gRPC; default 8080)")
    p.add_argument("--listen-host", default="0.0.0.0", help="address Envoy's public listener binds (default 0.0.0.0)")
    p.add_argument("--adapters", type=int, default=1, help="OpenAI HTTP adapter processes (default 1)")
    p.add_argument("--resolve-interval", type=float, default=5.0, help="seconds between DNS re-resolutions (default 5)")
    p.add_argument(
        "--start-timeout", type=float, default=120.0, help="seconds to wait for Envoy and the gateways (default 120)"
    )
    p.add_argument("--tls-cert", default="", help="PEM certificate: serve TLS on the public port (with --tls-key)")
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    return p


def resolve(targets: Sequence[str]) -> list[str]:
    """``ip:port`` for every IPv4 address each ``host:port`` resolves to (sorted, deduplicated)."""
    found: set[tuple[str, int]] = set()
    for target in targets:
        host, sep, port = target.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"gateway {target!r} must be host:port, e.g. gateway:50051")
        try:
            infos = socket.getaddrinfo(host, int(port), family=socket.AF_INET, type=socket.SOCK_STREAM)
        except socket.gaierror:
            continue  # not resolvable (yet): no replica of it is ready
        found.update((str(sockaddr[0]), int(sockaddr[1])) for *_, sockaddr in infos)
    return [f"{ip}:{port}" for ip, port in sorted(found)]


async def _resolved(targets: Sequence[str], interval_s: float, deadline_s: float) -> list[str]:
    loop = asyncio.get_running_loop()
    give_up = loop.time() + deadline_s
    while not (addresses := await asyncio.to_thread(resolve, targets)):
        if loop.time() > give_up:
            raise TimeoutError(f"no gateway address resolved from {','.join(targets)} within {deadline_s:.0f} s")
        await asyncio.sleep(min(interval_s, 1.0))  # DNS has no watch; bounded by the deadline
    return addresses


async def run(args: argparse.Namespace) -> int:
    from services.common.processes import stdout_sink
    from services.controlplane.frontdoor import FrontDoor

    targets = [t.strip() for t in args.gateways.split(",") if t.strip()]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    addresses = await _resolved(targets, args.resolve_interval, args.start_timeout)
    door = FrontDoor(
        addresses,
        stdout_sink(),
        http_port=args.http_port,
        listen_host=args.listen_host,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        adapters=args.adapters,
        timeout_s=args.start_timeout,
    )
    await door.start()
    log.info("frontdoor_started", port=door.port, gateways=addresses)
    try:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), args.resolve_interval)
            except TimeoutError:
                pass
            current = await asyncio.to_thread(resolve, targets)
            # An empty answer (DNS hiccup, or every replica restarting) keeps the last set: Envoy's health
            # checks already take dead replicas out, and an empty cluster would refuse every request.
            if current and current != door.xds.endpoints[GRPC_CLUSTER]:
                door.xds.set_endpoints(GRPC_CLUSTER, current)  # Envoy health-checks the new set itself
                log.info("frontdoor_gateways_changed", gateways=current)
    finally:
        await door.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    configure_logging("frontdoor")
    try:
        return asyncio.run(run(args))
    except (TimeoutError, RuntimeError, ValueError) as exc:
        print(f"meshserve frontdoor: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
