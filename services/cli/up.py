"""`meshserve up`: start the local mesh (services/local/mesh.py), print how to use it, restart what
crashes (services/local/supervise.py; ``--no-restart`` turns that off), stop on Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import shutil
import signal
import socket
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
from redis.exceptions import RedisError

from services.common.config import ClientSettings
from services.common.processes import LogSink, stdout_sink
from services.local.mesh import DEFAULT_MODELS_FILE, DEV_API_KEY, Mesh, MeshConfig

START_FAILURES = (RuntimeError, TimeoutError, OSError, RedisError, grpc.RpcError)
"""What :meth:`Mesh.start` raises when a child dies, is slow, or a tool (redis-server, Envoy) is missing."""


MAX_GATEWAYS = 16


def cli_command(cwd: Path | None = None, path: str | None = None) -> str:
    """How to type ``meshserve`` so that it runs this installation: ``meshserve`` when that name on
    ``PATH`` is the script beside this interpreter, else that script's path (relative to ``cwd`` when
    under it, as ``.venv/bin/meshserve`` after ``make run``), else ``python -m services.cli``."""
    script = Path(sys.executable).parent / "meshserve"
    if not script.exists():
        return f"{shlex.quote(sys.executable)} -m services.cli"
    found = shutil.which("meshserve", path=path)
    if found is not None and os.path.realpath(found) == os.path.realpath(script):
        return "meshserve"
    here = (cwd or Path.cwd()).resolve()
    absolute = script.parent.resolve() / script.name  # the venv's bin, not where its python links to
    try:
        shown = str(absolute.relative_to(here))
    except ValueError:
        shown = str(absolute)
    return shlex.quote(shown if "/" in shown else f"./{shown}")


def _gateway_replicas(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= count <= MAX_GATEWAYS:
        raise argparse.ArgumentTypeError(f"{count} gateway replicas: give 1 to {MAX_GATEWAYS}")
    return count


def _count(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if count < 0:
        raise argparse.ArgumentTypeError(f"{count}: give 0 or more")
    return count


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: give a number of seconds above 0")
    return seconds


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``meshserve up``'s arguments, with the checks that span several flags."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.stop_after_s is not None and args.min_replicas != 0:
        parser.error(
            "--stop-after-s stops every worker of the model, so it needs --min-replicas 0 "
            "(without it the model keeps that many replicas: use --idle-after-s to let them sleep)"
        )
    if args.stop_after_s is not None and args.no_restart:
        parser.error("--stop-after-s needs the supervisor that --no-restart turns off (it stops and starts workers)")
    return args


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshserve up", description="Start the local mesh as processes.")
    p.add_argument("--edge-workers", type=int, default=2, help="edge worker replicas (default 2)")
    p.add_argument("--cloud-workers", type=int, default=1, help="cloud worker replicas (default 1)")
    p.add_argument("--port", type=int, default=50051, help="gateway gRPC port (default 50051; 0 = any free port)")
    p.add_argument(
        "--gateways",
        type=_gateway_replicas,
        default=1,
        help="gateway replicas behind Envoy (default 1; the first on --port, the others on free ports; "
        "rate limits are shared through Redis)",
    )
    p.add_argument(
        "--redis-url",
        default=ClientSettings().redis_url,
        help="use this Redis as the cache Redis (default: $REDIS_URL, else start one on a free port); "
        "given alone, it holds the mesh's state too",
    )
    p.add_argument(
        "--state-redis-url",
        default=ClientSettings().state_redis_url,
        help="the Redis of the mesh's durable state: API keys, files, batches, stored responses (default: "
        "$MESHSERVE_STATE_REDIS_URL, else the --redis-url Redis when given, else start one with an "
        "append-only file in --state-dir)",
    )
    p.add_argument(
        "--state-dir",
        default=str(ClientSettings().state_redis_dir),
        help="data directory of the state Redis started here (default: beside the state file, "
        f"{ClientSettings().state_redis_dir}): batches and keys outlive the mesh",
    )
    p.add_argument("--edge-threads", type=int, default=1, help="intra-op threads per edge worker (default 1)")
    p.add_argument("--cloud-threads", type=int, default=2, help="intra-op threads per cloud worker (default 2)")
    p.add_argument(
        "--cloud-tp",
        type=int,
        default=1,
        help="tensor-parallel ranks per cloud worker (default 1; torchrun; 1 or 3 for SmolLM2)",
    )
    p.add_argument("--http-port", type=int, default=8080, help="Envoy's HTTP/gRPC port (default 8080; 0 = any)")
    p.add_argument("--no-envoy", action="store_true", help="do not start Envoy and the OpenAI HTTP front door")
    p.add_argument("--tls-cert", default="", help="PEM certificate: serve TLS on Envoy's port (with --tls-key)")
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    layout = p.add_mutually_exclusive_group()
    layout.add_argument(
        "--split-router",
        action="store_true",
        help="run the router as its own process, behind the gateway (one gRPC hop more; docs/gateway.md)",
    )
    layout.add_argument(
        "--embed-router", action="store_true", help="run the router inside the gateway process (the default)"
    )
    p.add_argument(
        "--edge-version",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="one more edge worker serving another build of the default model from DIR (an onnxruntime-genai "
        "directory prepared offline, e.g. <models>/smollm2-135m-instruct/draft-int8), as version NAME; "
        "traffic stays on the prepared build until `meshserve models rollout` (repeatable)",
    )
    p.add_argument(
        "--edge-model",
        action="append",
        default=[],
        metavar="ID=DIR",
        help="one more edge worker serving another model id from DIR (e.g. a distilled student's edge-int4) "
        "(repeatable)",
    )
    p.add_argument(
        "--models-file",
        default=str(DEFAULT_MODELS_FILE),
        metavar="PATH",
        help="the routers' models file: served models, versions and their generation defaults "
        "(default: deploy/models.yaml, the default model with its model card's sampling; '' for none: "
        "each model's checkpoint defaults only)",
    )
    idle = p.add_argument_group(
        "idle policy of the default model (the models file's `idle:`, docs/deploy.md *Scale from zero*)"
    )
    idle.add_argument(
        "--min-replicas",
        type=_count,
        default=None,
        metavar="N",
        help="replicas kept awake while idle (default: the models file's, else 1); 0 lets every one sleep",
    )
    idle.add_argument(
        "--idle-after-s",
        type=_seconds,
        default=None,
        metavar="S",
        help="seconds without a request after which workers sleep: the process stays, the model's memory "
        "is released, and the next request wakes it (default: the models file's, else never)",
    )
    idle.add_argument(
        "--stop-after-s",
        type=_seconds,
        default=None,
        metavar="S",
        help="with --min-replicas 0: seconds without a request after which the model's worker processes "
        "are stopped; a request then is held while one starts again",
    )
    p.add_argument(
        "--no-restart",
        action="store_true",
        help="do not restart a service that exits (by default each is restarted with backoff, "
        "as compose's restart: unless-stopped; `meshserve status` shows restarts)",
    )
    p.add_argument("--demo", metavar="PROMPT", help="once up, stream an answer to PROMPT through the gateway")
    p.add_argument("--exit-after-demo", action="store_true", help="stop the mesh after the demo answer")
    return p


class HoldingSink:
    """The mesh's log sink, able to hold lines back while the demo answer streams, so that a service's
    line (the gateway's ``request_done``) does not land in the middle of the answer. Held lines are
    written, in order, when the hold ends, or once ``limit`` lines are held (the hold then ends)."""

    def __init__(self, inner: LogSink, limit: int = 1000) -> None:
        self.inner = inner
        self.limit = limit
        self._held: list[tuple[str, str]] | None = None

    def __call__(self, name: str, line: str) -> None:
        if self._held is None:
            self.inner(name, line)
            return
        self._held.append((name, line))
        if len(self._held) >= self.limit:
            self._release()

    def _release(self) -> None:
        held, self._held = self._held or [], None
        for name, line in held:
            self.inner(name, line)

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        self._held = []
        try:
            yield
        finally:
            self._release()


def busy_port(args: argparse.Namespace) -> str | None:
    """One line naming the first fixed port of the mesh that is already taken on 127.0.0.1 (a mesh
    already running, say), checked before anything starts; None when all are free."""
    ports = [(args.port, "the gateway's", "--port")]
    if not args.no_envoy:
        ports.append((args.http_port, "Envoy's", "--http-port"))
    for port, whose, flag in ports:
        if port == 0:
            continue
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is no conflict
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                return (
                    f"meshserve up: port {port} ({whose}) is in use on 127.0.0.1; is a mesh already running "
                    f"(`meshserve status`)? Stop it, or pass {flag} with a free port (0 picks one)"
                )
    return None


def _pairs(items: Sequence[str], usage: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        name, sep, directory = item.partition("=")
        if not sep or not name or not directory:
            raise SystemExit(f"meshserve up: {item!r} must be {usage}")
        if not Path(directory, "genai_config.json").is_file():
            raise SystemExit(f"meshserve up: {directory} holds no genai_config.json; give a prepared ONNX model dir")
        out[name] = directory
    return out


async def run_up(args: argparse.Namespace) -> int:
    if (busy := busy_port(args)) is not None:
        print(busy, file=sys.stderr)
        return 1
    api_key = ClientSettings().api_key
    if api_key is None:
        api_key = DEV_API_KEY
    config = MeshConfig(
        edge_workers=args.edge_workers,
        cloud_workers=args.cloud_workers,
        gateways=args.gateways,
        gateway_port=args.port,
        redis_url=args.redis_url,
        state_redis_url=args.state_redis_url or None,
        state_dir=args.state_dir,
        api_key=api_key,
        edge_threads=args.edge_threads,
        cloud_threads=args.cloud_threads,
        cloud_tp=args.cloud_tp,
        envoy=not args.no_envoy,
        http_port=args.http_port,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        embed_router=not args.split_router,
        edge_versions=_pairs(args.edge_version, "--edge-version NAME=DIR"),
        models_file=args.models_file,
        edge_models=_pairs(args.edge_model, "--edge-model ID=DIR"),
        supervise=not args.no_restart,
        min_replicas=args.min_replicas,
        idle_after_s=args.idle_after_s,
        stop_after_s=args.stop_after_s,
    )
    sink = HoldingSink(stdout_sink())
    mesh = Mesh(config, sink=sink)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print("meshserve: starting the mesh (first start loads the models)...", file=sys.stderr, flush=True)
    failed = await _start(mesh, stop)
    if failed is not None:
        return failed
    from services.local.state import write_state

    state = write_state(mesh.describe())  # for `meshserve status`
    mesh.on_change = lambda: write_state(mesh.describe())  # a service exited or came back: its restarts
    cli = cli_command()  # `meshserve` itself is often not on PATH (make run uses .venv/bin/meshserve)
    try:
        print(
            f"\nmeshserve: mesh is up. gRPC gateway at {mesh.gateway_address} (API key: {api_key})\n"
            + (
                f"  gateway replicas: {', '.join(mesh.gateway_addresses)} (Envoy balances over them)\n"
                if len(mesh.gateway_addresses) > 1
                else ""
            )
            + f'  try: {cli} chat --address {mesh.gateway_address} "Tell me about the sea"\n'
            f"  cache admin: {cli} cache --address {mesh.cache_address} stats\n"
            f"  API keys: {cli} keys create --tenant NAME (kept in this mesh's state Redis)\n"
            + (
                f"  state (keys, files, batches, stored responses): {mesh.state_redis_url}, "
                f"append-only file in {mesh.state_dir}\n"
                if mesh.state_dir
                else ""
            )
            + f"  metrics: {mesh.metrics_endpoints()}\n"
            + (
                f"  OpenAI-compatible HTTP (and gRPC) through Envoy: {mesh.http_base_url}\n"
                if mesh.front_door is not None
                else ""
            )
            + "".join(
                f"  scale from zero: {p.pool}'s workers ({', '.join(p.workers)}) stop after {p.stop_after_s:g} s "
                "without a request; a request then starts one\n"
                for p in (mesh.scaler.policies if mesh.scaler is not None else [])
            )
            + f"  live view: {cli} status\n"
            + "  Ctrl-C stops everything.\n",
            file=sys.stderr,
            flush=True,
        )
        if args.demo:
            from services.cli.client import print_stream

            with sink.holding():
                await print_stream(mesh.gateway_address, api_key, args.demo, max_tokens=96)
            if args.exit_after_demo:
                return 0
        await stop.wait()
        print("\nmeshserve: stopping (draining in-flight streams)...", file=sys.stderr, flush=True)
        return 0
    finally:
        mesh.on_change = None
        state.unlink(missing_ok=True)
        await mesh.stop()


async def _start(mesh: Mesh, stop: asyncio.Event) -> int | None:
    """Start ``mesh``, or give up when ``stop`` is set first (Ctrl-C, SIGTERM) or a service fails to
    start; either way what was started is stopped. None once the mesh is up, else the exit code: 0 when
    stopped (as a Ctrl-C once up), 1 when a service failed (one line on stderr, no traceback)."""
    starting = asyncio.create_task(mesh.start())
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if not starting.done():
        print("\nmeshserve: stopping what has started...", file=sys.stderr, flush=True)
        starting.cancel()  # Mesh.start stops its children on the way out
        with contextlib.suppress(asyncio.CancelledError, *START_FAILURES):
            await starting
        await mesh.stop()
        return 0
    try:
        starting.result()
    except START_FAILURES as exc:  # Mesh.start has stopped everything it started
        reason = " ".join(str(exc).split()) or f"{type(exc).__name__} while starting"  # one line
        print(f"meshserve up: the mesh did not start: {reason}", file=sys.stderr, flush=True)
        return 1
    return None


def main(argv: Sequence[str] | None = None) -> int:
    return asyncio.run(run_up(parse_args(argv)))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
