"""``meshserve serve SERVICE`` and ``meshserve health ADDRESS``: the entry points of container images.

``serve`` execs ``python -m <module>`` of one service, the very command ``meshserve up`` starts for
it (:data:`SERVICES` is the one table of service name -> module), so a container, a torchrun rank
(``torchrun --no-python meshserve serve gpu-worker``) and a local mesh child run the same program
with the same ``MESHSERVE_<SERVICE>_*`` environment.

``health`` is a one-shot ``grpc.health.v1.Health/Check`` for container healthchecks (docker compose
has no native gRPC probe): exit 0 when the service reports SERVING, 1 otherwise, with one line on
stderr saying why.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

SERVICES: dict[str, str] = {
    "gateway": "services.gateway",
    "gateway-http": "services.gateway.http",
    "router": "services.router",
    "cache": "services.cache",
    "batch": "services.batch",
    "edge-worker": "services.edge_worker",
    "gpu-worker": "services.gpu_worker",
}
"""Service names accepted by ``meshserve serve`` and the module each one runs."""


def module_of(service: str) -> str:
    """The module ``meshserve serve <service>`` runs; ValueError naming the choices if unknown."""
    try:
        return SERVICES[service]
    except KeyError:
        raise ValueError(f"unknown service {service!r}; choose one of {', '.join(SERVICES)}") from None


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="meshserve serve",
        description="Run one meshserve service in the foreground (configured by MESHSERVE_<SERVICE>_* env vars).",
    )
    p.add_argument("service", choices=list(SERVICES), help="which service to run")
    return p


def serve_main(argv: Sequence[str] | None = None) -> int:
    args = serve_parser().parse_args(argv)
    module = module_of(args.service)
    # exec, not runpy: the service becomes this process (PID 1 in a container gets SIGTERM directly).
    os.execv(sys.executable, [sys.executable, "-m", module])
    return 0  # pragma: no cover - execv does not return


def health_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="meshserve health", description="Exit 0 if the gRPC service at ADDRESS reports SERVING (grpc.health.v1)."
    )
    p.add_argument("address", help="host:port of a meshserve service (or of Envoy, which forwards to a gateway)")
    p.add_argument("--service", default="", help="health service name to ask about ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)")
    return p


def check_health(address: str, service: str = "", timeout_s: float = 3.0) -> str:
    """The reported status name (``SERVING``, ``NOT_SERVING``, ...); raises grpc.RpcError if unreachable."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
        )
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def health_main(argv: Sequence[str] | None = None) -> int:
    import grpc

    args = health_parser().parse_args(argv)
    try:
        status = check_health(args.address, args.service, args.timeout)
    except grpc.RpcError as exc:
        code = exc.code().name if isinstance(exc, grpc.Call) else "UNKNOWN"
        if code == "NOT_FOUND":  # it answered: the name is not one it reports on
            print(f"meshserve health: {args.address} knows no health service {args.service!r}", file=sys.stderr)
            return 1
        print(f"meshserve health: {args.address} did not answer ({code}); is the service running?", file=sys.stderr)
        return 1
    if status != "SERVING":
        print(f"meshserve health: {args.address} reports {status}", file=sys.stderr)
        return 1
    return 0
