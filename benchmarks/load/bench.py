"""``meshserve bench load``: open- or closed-loop load through the mesh, with baselines, JSON + PNG.

Starts the local mesh (the launcher of ``meshserve up``; Envoy too for ``--transport http``) unless
``--address`` / ``--http-url`` point at a running one, then for each load step (``--rates`` in open
loop, ``--concurrency`` in closed loop) runs every target in turn on the same seeded requests:

* ``mesh_grpc``: gRPC ``Generate``/``Chat`` through the gateway (API key, limits, router, workers);
* ``mesh_http``: streaming OpenAI HTTP through Envoy → HTTP adapter → gateway;
* ``direct_worker`` (``--baselines direct``): edge worker 0 over its internal API — what the mesh adds;
* ``naive_transformers`` (``--baselines naive``): :mod:`benchmarks.load.naive_server`, ``model.generate``
  in a thread per request — what a user would write first.

Writes docs/benchmarks/<name>.json and .md, <name>_e2e.png, <name>_ttft.png, <name>_throughput.png.
``--compare A.json B.json`` prints two runs side by side instead. LiteLLM's gateway overhead is
:mod:`benchmarks.gateway.vs_litellm` (``meshserve bench gateways``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import random
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from tqdm import tqdm

from benchmarks import charts
from benchmarks.load import report as load_report
from benchmarks.load.generator import (
    Result,
    Sender,
    Workload,
    closed_loop,
    make_items,
    open_loop,
    poisson_schedule,
    summarize,
)
from benchmarks.load.senders import grpc_sender, http_sender, worker_sender
from services.cli.client import MeshClient
from services.common.pb.meshserve.internal.v1 import worker_pb2_grpc
from services.common.processes import ServiceProcess
from services.local.mesh import DEV_API_KEY, Mesh, MeshConfig

UNLIMITED = {
    "MESHSERVE_GATEWAY_REQUESTS_PER_MINUTE": "100000000",
    "MESHSERVE_GATEWAY_TOKENS_PER_MINUTE": "1000000000",
    "MESHSERVE_GATEWAY_MAX_CONCURRENT_STREAMS": "4096",
}
"""The benchmark measures the mesh, not the dev tenant's limits."""


def parse_mix(text: str) -> dict[str, float]:
    """``short=0.7,long=0.1,chat=0.2`` → fractions (missing kinds are 0)."""
    out = {"short": 0.0, "long": 0.0, "chat": 0.0}
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, _, value = part.partition("=")
        if kind not in out or not value:
            raise argparse.ArgumentTypeError(f"bad mix entry {part!r}; use e.g. short=0.7,long=0.1,chat=0.2")
        out[kind] = float(value)
    return out


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


@contextlib.asynccontextmanager
async def targets(args: argparse.Namespace) -> AsyncIterator[dict[str, Sender]]:
    """The senders to run, with whatever they need started (and stopped afterwards)."""
    async with contextlib.AsyncExitStack() as stack:
        mesh: Mesh | None = None
        if not args.address and not args.http_url:
            config = MeshConfig(
                edge_workers=args.edge_workers, cloud_workers=args.cloud_workers, envoy=args.transport != "grpc"
            )
            config.extra_env.update(UNLIMITED)
            print("bench load: starting the mesh...", file=sys.stderr, flush=True)
            mesh = await stack.enter_async_context(Mesh(config, sink=lambda _n, _l: None))
        session = await stack.enter_async_context(aiohttp.ClientSession())
        senders: dict[str, Sender] = {}
        api_key = os.environ.get("MESHSERVE_API_KEY", DEV_API_KEY)
        if args.transport in ("grpc", "both"):
            address = args.address or (mesh.gateway_address if mesh else "")
            if address:
                client = await stack.enter_async_context(MeshClient(address, api_key))
                await client.wait_ready()
                senders["mesh_grpc"] = grpc_sender(client, args.timeout)
        if args.transport in ("http", "both"):
            url = args.http_url or (mesh.http_base_url.removesuffix("/v1") if mesh else "")
            if url:
                senders["mesh_http"] = http_sender(session, url, api_key=api_key, timeout_s=args.timeout)
        if "direct" in args.baselines:
            worker = args.worker_address or (mesh.workers("edge")[0].address if mesh else "")
            if not worker:
                raise SystemExit("bench load: --baselines direct needs the harness's mesh or --worker-address")
            from services.common.model_paths import model_paths
            from services.common.tokenizer import Tokenizer

            channel = await stack.enter_async_context(grpc.aio.insecure_channel(worker))
            tokenizer = Tokenizer(model_paths().hf_dir)
            senders["direct_worker"] = worker_sender(worker_pb2_grpc.WorkerStub(channel), tokenizer.encode)
        if "naive" in args.baselines:
            env = {**os.environ, "PYTHONUNBUFFERED": "1", "MESHSERVE_NAIVE_THREADS": str(args.naive_threads)}
            proc = ServiceProcess(
                "naive", [sys.executable, "-m", "benchmarks.load.naive_server"], env, lambda _n, _l: None
            )
            await proc.spawn()
            stack.push_async_callback(proc.stop)
            await proc.wait_started(180)
            senders["naive_transformers"] = http_sender(session, f"http://{proc.address}", timeout_s=args.timeout)
        if not senders:
            raise SystemExit("bench load: nothing to measure; check --transport / --baselines")
        yield senders


async def run(args: argparse.Namespace) -> dict[str, Any]:
    mix = parse_mix(args.mix)
    workload = Workload(
        mix["short"],
        mix["long"],
        mix["chat"],
        cache_hit_ratio=args.cache_hit_ratio,
        max_tokens=args.max_tokens,
        long_repeats=args.long_repeats,
    )
    loads = args.rates if args.mode == "open" else [int(c) for c in args.concurrency]
    report: dict[str, Any] = {
        "benchmark": "load",
        "name": args.name,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_1m": os.getloadavg()[0]},
        "command": " ".join(["meshserve bench load", *args.argv]),
        "mode": args.mode,
        "workload": workload.__dict__,
        "duration_s": args.duration,
        "max_requests": args.requests,
        "targets": {},
    }
    nonce = dt.datetime.now(dt.UTC).strftime("%H%M%S%f")
    async with targets(args) as senders:
        for send in senders.values():  # warm every path (first requests load kernels, open channels)
            warm = make_items(workload, args.warmup, random.Random(-1))
            await closed_loop(send, warm, 1, 60.0, timeout_s=args.timeout)
        for load in loads:
            for name, send in senders.items():
                rng = random.Random(args.seed)
                items = make_items(workload, args.requests, rng, tag=f"{nonce}-{name}-{load:g}-")
                step = await _step(args, send, items, load, f"{name} @ {load:g}", rng)
                report["targets"].setdefault(name, []).append({"load": load, "summary": step})
                print(load_report.step_line(name, load, step), file=sys.stderr, flush=True)
    return report


async def _step(
    args: argparse.Namespace, send: Sender, items: list[Any], load: float, label: str, rng: random.Random
) -> dict[str, Any]:
    bar = tqdm(total=len(items), desc=label, unit="req", file=sys.stderr, leave=False, disable=args.quiet)

    def done(_result: Result) -> None:
        bar.update(1)

    try:
        if args.mode == "open":
            arrivals = poisson_schedule(load, args.duration, len(items), rng)
            results, wall = await open_loop(
                send, items[: len(arrivals)], arrivals, timeout_s=args.timeout, on_done=done
            )
        else:
            results, wall = await closed_loop(
                send, items, int(load), args.duration, timeout_s=args.timeout, on_done=done
            )
    finally:
        bar.close()
    return summarize(results, wall)


def write(report: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    name = report["name"]
    (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    paths = [
        charts.latency_chart(report, out / f"{name}_e2e.png", "e2e_ms"),
        charts.latency_chart(report, out / f"{name}_ttft.png", "ttft_ms"),
        charts.throughput_chart(report, out / f"{name}_throughput.png"),
    ]
    (out / f"{name}.md").write_text(load_report.markdown(report))
    return [out / f"{name}.json", out / f"{name}.md", *paths]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=("open", "closed"), default="closed", help="open (Poisson) or closed loop")
    p.add_argument("--rates", type=_floats, default=[1.0, 2.0, 4.0], help="open loop: requests/s steps (1,2,4)")
    p.add_argument("--concurrency", type=_floats, default=[1, 2, 4, 8], help="closed loop: streams steps (1,2,4,8)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds per step at most (default 20)")
    p.add_argument("--requests", type=int, default=100, help="requests per step at most (default 100)")
    p.add_argument("--warmup", type=int, default=3, help="requests per target before measuring (default 3)")
    p.add_argument("--mix", default="short=1", help="request kinds, e.g. short=0.7,long=0.1,chat=0.2")
    p.add_argument("--cache-hit-ratio", type=float, default=0.0, help="share of repeated greedy prompts (0..1)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per request (default 16)")
    p.add_argument("--long-repeats", type=int, default=10, help="paragraphs in a long prompt (10 ≈ 300 tokens)")
    p.add_argument("--transport", choices=("grpc", "http", "both"), default="grpc", help="how to reach the mesh")
    p.add_argument("--baselines", default="", help="comma list: direct (worker called directly), naive (transformers)")
    p.add_argument("--address", default="", help="gateway host:port of a running mesh (default: start one)")
    p.add_argument("--http-url", default="", help="front door base URL of a running mesh, e.g. http://127.0.0.1:8080")
    p.add_argument("--worker-address", default="", help="worker for --baselines direct with --address")
    p.add_argument("--edge-workers", type=int, default=2, help="edge workers of the started mesh (default 2)")
    p.add_argument("--cloud-workers", type=int, default=1, help="cloud workers of the started mesh (default 1)")
    p.add_argument("--naive-threads", type=int, default=2, help="torch threads of the naive server (default 2)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds one request may take (default 60)")
    p.add_argument("--seed", type=int, default=7, help="RNG seed of arrivals and workload (default 7)")
    p.add_argument("--name", default="load", help="output file stem under --out (default load)")
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks"), help="output directory")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="print two runs' JSON side by side")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshserve bench load", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.compare:
        a, b = (json.loads(p.read_text()) for p in args.compare)
        print(load_report.compare(a, b, str(args.compare[0]), str(args.compare[1])))
        return 0
    args.baselines = [b.strip() for b in args.baselines.split(",") if b.strip()]
    unknown = set(args.baselines) - {"direct", "naive"}
    if unknown:
        parser.error(f"unknown baseline(s) {', '.join(sorted(unknown))}; choose from direct, naive")
    try:
        report = asyncio.run(run(args))
    except ValueError as exc:
        parser.error(str(exc))
    for path in write(report, args.out):
        print(f"wrote {path}", file=sys.stderr)
    print(load_report.markdown(report))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
