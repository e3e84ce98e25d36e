"""``python -m benchmarks.mesh.restart``: how long each kind of service of ``meshserve up`` takes to come
back by itself after ``kill -9`` under load (issue 26's target: within 10 s).

Measured as tests/fault/test_supervised_mesh.py measures it: a mesh started as ``meshserve up``
starts it (``MeshConfig(supervise=True)``: 2 edge workers, 1 cloud worker, cache, gateway with its
embedded router, its own Redis, a batch runner), greedy streams running through the gateway, then
``kill -9`` of one service (the busiest edge worker, the cloud worker, the cache service, Redis, the
gateway); the time is from the kill until its supervisor has it serving again (its record's restart
count up and its state ``running``: the restarted process answered its readiness check, gRPC health
SERVING for the services, PING for Redis). For a worker, the time until the router lists it healthy
again (it registered by heartbeat) is reported too. Each round kills every service once; the
TARGET lines judge the median over rounds.

Also (``--phases``): the start phases of a lone edge and cloud worker process (spawn → settings and
imports done → model loaded and gRPC serving → SERVING after warm-up), of this checkout and, with
``--before DIR``, of another checkout (e.g. a worktree of the commit before the change), run
alternately in the same run so both see the same machine.

Writes docs/benchmarks/restart.json and restart.md; prints the TARGET lines and the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from services.cli.status import gather
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.processes import ServiceProcess
from services.local.mesh import DEV_API_KEY, Mesh, MeshConfig

TARGET_S = 10.0
SERVICES = ("edge", "cloud-0", "cache", "redis", "gateway")
"""What is killed, in order; ``edge`` is whichever edge worker runs the most sequences at the time."""
ROUTER_ENV = {  # as the fault test's mesh (tests/fault/conftest.py): faults show in seconds
    "MESHSERVE_ROUTER_STALL_TIMEOUT_S": "10",
    "MESHSERVE_ROUTER_EJECT_MAX_S": "2",
    "MESHSERVE_ROUTER_READMIT_S": "0",
    "MESHSERVE_ROUTER_HEALTH_TIMEOUT_S": "1",
    "MESHSERVE_ROUTER_RESUME_SAME_BUILD_WAIT_S": "60",
}
PROMPT = "Tell me a long story about a lighthouse keeper and a storm. Chapter {i}."
OUT = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _sink(name: str, line: str) -> None:
    if '"level": "error"' in line or "Traceback" in line:
        sys.stderr.write(f"{name} | {line}\n")


async def _stream_forever(stub: inference_pb2_grpc.InferenceStub, i: int, tier: Any, stop: asyncio.Event) -> None:
    """Greedy streams one after another until ``stop`` (errors, from a killed gateway, are retried)."""
    request = pb.GenerateRequest(
        prompt=PROMPT.format(i=i),
        sampling=pb.SamplingParams(max_tokens=48, temperature=0.0),
        routing=pb.RoutingOptions(tier=tier, cache_policy=pb.CACHE_POLICY_BYPASS),
    )
    metadata = (("authorization", f"Bearer {DEV_API_KEY}"),)
    while not stop.is_set():
        try:
            async for _ in stub.Generate(request, metadata=metadata, timeout=120):
                if stop.is_set():
                    break
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.2)


async def _healthy_workers(mesh: Mesh) -> int:
    try:
        view = await gather(mesh.router_address)
    except Exception:  # the gateway (and its router) is being restarted
        return 0
    return sum(r.healthy for r in view.replicas)


async def _kill_and_time(mesh: Mesh, name: str, workers: int) -> dict[str, float]:
    assert mesh.supervisor is not None
    record = mesh.supervisor.records[name]
    restarts = record.restarts
    proc = mesh._redis if name == "redis" else mesh.processes[name]
    assert proc is not None
    began = time.monotonic()
    await proc.kill()
    while not (record.restarts > restarts and record.state == "running"):
        if time.monotonic() - began > 300:
            raise TimeoutError(f"{name} not back within 300 s: {record}")
        await asyncio.sleep(0.05)
    result = {"back_s": time.monotonic() - began}
    if name.startswith(("edge-", "cloud-")):
        while await _healthy_workers(mesh) < workers:  # noqa: ASYNC110 (the router's view: polled)
            await asyncio.sleep(0.05)
        result["registered_s"] = time.monotonic() - began
    return result


async def _busiest_edge(mesh: Mesh) -> str:
    from services.common.config import DEFAULT_INTERNAL_TOKEN
    from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc

    loads: dict[str, int] = {}
    for worker in mesh.workers("edge"):
        async with grpc.aio.insecure_channel(worker.address) as channel:
            stats = await worker_pb2_grpc.WorkerStub(channel).Stats(
                worker_pb2.StatsRequest(), metadata=(("x-meshserve-internal-token", DEFAULT_INTERNAL_TOKEN),)
            )
        loads[worker.name] = stats.active_sequences
    return max(loads, key=lambda name: loads[name])


async def measure_restarts(rounds: int, streams: int) -> dict[str, Any]:
    config = MeshConfig(edge_workers=2, cloud_workers=1, extra_env=ROUTER_ENV, supervise=True)
    times: dict[str, list[dict[str, float]]] = {name: [] for name in SERVICES}
    loads: list[str] = []
    async with Mesh(config, sink=_sink) as mesh:
        workers = len(mesh.workers("edge")) + len(mesh.workers("cloud"))
        async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            for round_ in range(rounds):
                for name in SERVICES:
                    stop = asyncio.Event()
                    tiers = [
                        pb.TIER_CLOUD if name.startswith("cloud") and i % 2 else pb.TIER_EDGE for i in range(streams)
                    ]
                    load = [asyncio.create_task(_stream_forever(stub, i, t, stop)) for i, t in enumerate(tiers)]
                    await asyncio.sleep(3.0)  # the streams are decoding
                    victim = await _busiest_edge(mesh) if name == "edge" else name
                    result = await _kill_and_time(mesh, victim, workers)
                    loads.append(_load())
                    stop.set()
                    await asyncio.gather(*load, return_exceptions=True)
                    times[name].append(result)
                    print(f"round {round_ + 1} {victim}: {json.dumps(result)} (load {loads[-1]})", flush=True)
                    while await _healthy_workers(mesh) < workers:  # noqa: ASYNC110 (settled before the next kill)
                        await asyncio.sleep(0.2)
    summary = {}
    for name, results in times.items():
        back = [r["back_s"] for r in results]
        entry = {"back_s": back, "back_s_median": statistics.median(back)}
        if results and "registered_s" in results[0]:
            registered = [r["registered_s"] for r in results]
            entry |= {"registered_s": registered, "registered_s_median": statistics.median(registered)}
        summary[name] = entry
    return {"services": summary, "load_average_at_kills": loads}


async def _start_phases(root: Path, module: str, env: dict[str, str]) -> dict[str, float]:
    """Seconds from spawn to each startup log line of one worker process run from checkout ``root``."""
    seen: dict[str, float] = {}
    began = time.monotonic()

    def sink(_name: str, line: str) -> None:
        try:
            event = json.loads(line).get("event", "")
        except ValueError:
            return
        if event in ("model_loading", "service_started", "worker_ready") and event not in seen:
            seen[event] = time.monotonic() - began

    full_env = {**os.environ, "PYTHONPATH": str(root), **env}
    proc = ServiceProcess(module, [sys.executable, "-m", module], full_env, sink)
    here = Path.cwd()
    os.chdir(root)  # `python -m` puts its working directory first on sys.path: that checkout's code runs
    try:
        began = time.monotonic()
        await proc.spawn()
    finally:
        os.chdir(here)
    await proc.wait_started(300)
    await proc.wait_serving(300)
    seen["serving"] = time.monotonic() - began
    await proc.stop(15)
    return seen


PHASE_ENV = {
    "services.edge_worker": {"MESHSERVE_EDGE_WORKER_PORT": "0", "MESHSERVE_EDGE_WORKER_THREADS": "1"},
    "services.gpu_worker": {"MESHSERVE_GPU_WORKER_PORT": "0", "MESHSERVE_GPU_WORKER_THREADS": "2"},
}


ROOT = Path(__file__).resolve().parents[2]


async def measure_phases(before: Path | None, rounds: int) -> dict[str, Any]:
    trees = {"after": ROOT, **({"before": before} if before else {})}
    runs: dict[str, dict[str, list[dict[str, float]]]] = {m: {t: [] for t in trees} for m in PHASE_ENV}
    for round_ in range(rounds):
        for module, env in PHASE_ENV.items():
            order = list(trees.items())
            for tree, root in order[::-1] if round_ % 2 else order:  # alternately, ABBA: the same machine
                phases = await _start_phases(root, module, env)
                phases["load"] = float(_load().split()[0])
                runs[module][tree].append(phases)
                print(f"{module} [{tree}] {json.dumps({k: round(v, 2) for k, v in phases.items()})}", flush=True)
    medians = {
        module: {
            tree: {key: statistics.median(r[key] for r in results) for key in results[0]}
            for tree, results in by_tree.items()
        }
        for module, by_tree in runs.items()
    }
    return {"runs": runs, "medians": medians}


def target_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    for name, entry in result["restarts"]["services"].items():
        value = entry["back_s_median"]
        verdict = "PASS" if value <= TARGET_S else "FAIL"
        lines.append(f"TARGET restart_{name.split('-')[0]}: {value:.1f} (target <= {TARGET_S:g}): {verdict}")
    return lines


def render(result: dict[str, Any]) -> str:
    out = [
        "# Restart of a killed service in `meshserve up` (issue 26)",
        "",
        f"{result['date']} · {result['cpus']} CPUs shared with other work · load average at the kills: "
        f"{', '.join(result['restarts']['load_average_at_kills'])} · `{result['command']}`",
        "",
        "`kill -9` of each service under load (greedy streams through the gateway), the mesh of "
        "`meshserve up` (2 edge workers, 1 cloud worker, cache, gateway with its router, Redis, batch runner). "
        "Back = from the kill until its supervisor has it serving again (readiness check passed), as "
        "tests/fault/test_supervised_mesh.py measures; registered = until the router lists the worker "
        "healthy again. Median of the rounds.",
        "",
        "```",
        *target_lines(result),
        "```",
        "",
        "| service | back s (median) | every round | registered s (median) |",
        "|---|---:|---|---:|",
    ]
    for name, e in result["restarts"]["services"].items():
        rounds = ", ".join(f"{v:.1f}" for v in e["back_s"])
        registered = f"{e['registered_s_median']:.1f}" if "registered_s_median" in e else ""
        out.append(f"| {name} | {e['back_s_median']:.1f} | {rounds} | {registered} |")
    phases = result.get("phases")
    if phases:
        out += [
            "",
            "## Start phases of a lone worker process (seconds from spawn, median; before and after run alternately)",
            "",
            "`model_loading`: interpreter, imports and settings done; `service_started`: model loaded, gRPC "
            "listening; `serving`: warm-up done, health SERVING. Load = 1-min load average at the end. "
            f"Before: {result.get('before') or 'not run'}; after: this checkout, its load caches filled by an "
            "earlier start (as for a restart). A fresh process each, no warm spare (that is the mesh's, above).",
            "",
            "| worker | checkout | model_loading | service_started | serving | load |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for module, by_tree in phases["medians"].items():
            for tree, m in by_tree.items():
                out.append(
                    f"| {module.split('.')[1]} | {tree} | {m.get('model_loading', 0):.2f} | "
                    f"{m.get('service_started', 0):.2f} | {m['serving']:.2f} | {m['load']:.1f} |"
                )
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1, help="kills of each service")
    parser.add_argument("--streams", type=int, default=6, help="greedy streams running during each kill")
    parser.add_argument("--phases", type=int, default=0, help="rounds of the lone-worker start phases (0: skip)")
    parser.add_argument("--before", type=Path, help="a checkout to compare the start phases with")
    parser.add_argument("--before-label", default="", help="what --before is (e.g. the commit it was exported from)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    result: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(
            ["python", "-m", "benchmarks.mesh.restart", *(argv if argv is not None else sys.argv[1:])]
        ),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "target_s": TARGET_S,
        "before": args.before_label or (str(args.before) if args.before else ""),
    }
    if args.phases:
        result["phases"] = asyncio.run(measure_phases(args.before.resolve() if args.before else None, args.phases))
    result["restarts"] = asyncio.run(measure_restarts(args.rounds, args.streams))
    result["load_average_end"] = _load()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "restart.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "restart.md").write_text(render(result))
    for line in target_lines(result):
        print(line)
    print(f"load average: {result['load_average_end']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
