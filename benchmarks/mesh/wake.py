"""``meshserve bench wake``: what a sleeping or stopped model costs its first request (issue 39).

Starts local meshes (the launcher of ``meshserve up``) and measures, each against the same model
awake in the same run:

- **edge and cloud wake**: the time to the first token of a short prompt (greedy, 1 token, response
  cache bypassed) on an awake replica, then on the same replica put to sleep (``Worker.Sleep``): the
  router holds the request and wakes the replica. ``--rounds`` interleaved pairs, medians compared.
- **memory**: the edge worker's resident memory (``WorkerStats.resident_bytes``) awake and asleep.
- **64 at once**: 64 requests reach a sleeping edge model together; all must complete, and the
  router's ``meshserve_router_wakes_total`` must grow by exactly 1.
- **neighbours**: TTFT p50 of requests to an awake model (the default one) while another model
  (a second edge model id) is put to sleep and woken again and again, against a run with no wake.
- **from zero**: a mesh with ``min_replicas 0`` and a stop policy: once the scaler of ``meshserve up``
  has stopped the edge worker process, the time from a request's arrival to its first token.
- **by model size** (``--sizes``, no target of its own): the edge wake pairs again for random-weight
  models of larger shapes (benchmarks/checkpoints.py), each prepared once as the default model is
  (the INT4 edge graph, under ~/.cache/meshserve/bench-models: ~7 GB for the default two, a few
  minutes the first time) and served by a mesh of its own: how what a sleeping worker keeps compares
  with the same worker awake as the model grows.

Writes docs/benchmarks/wake.json and wake.md with TARGET lines (and prints them).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

from benchmarks import earlier_runs
from benchmarks.checkpoints import SHAPES, build_checkpoint, parameters
from benchmarks.report import target_line
from benchmarks.stats import percentile
from services.cli.client import MeshClient, routing_options, sampling_params
from services.common.config import DEFAULT_INTERNAL_TOKEN
from services.common.model_paths import DEFAULT_MODEL_ID, default_models_dir, model_paths
from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.local.mesh import DEV_API_KEY, Mesh, MeshConfig
from services.models.prepare import edge_complete, prepare, read_manifest
from services.models.sources import Source

INTERNAL = (("x-meshserve-internal-token", DEFAULT_INTERNAL_TOKEN),)
PROMPT = "The capital of France is"
OTHER_MODEL = "wake-bench-other"
"""The second edge model id of the neighbours phase (the default model's INT4 graph under another id)."""

TARGETS = {
    "edge_wake_extra_ttft_s": 1.5,
    "cloud_wake_extra_ttft_s": 3.0,
    "edge_asleep_resident_share": 0.20,
    "from_zero_ttft_s": 8.0,
    "neighbour_ttft_p50_ratio": 1.10,
}
SIZES = ("360m", "1b")
"""The random-weight shapes of the report's by-size table (``--sizes``), beside the default model (135M)."""
STATE = worker_pb2.ModelState


def _log(text: str) -> None:
    print(f"wake: {text}", file=sys.stderr, flush=True)


def _config(**kw: Any) -> MeshConfig:
    config = MeshConfig(**kw)
    config.extra_env["MESHSERVE_GATEWAY_REQUESTS_PER_MINUTE"] = "100000000"
    config.extra_env["MESHSERVE_GATEWAY_MAX_CONCURRENT_STREAMS"] = "1000"  # the tenant's 16 would refuse the burst
    config.extra_env["MESHSERVE_ROUTER_WAKE_DEADLINE_S"] = "120"
    return config


async def _ttft(client: MeshClient, tier: str, model: str = "") -> float:
    """Seconds from the call to its first token (a short greedy prompt, cache bypassed)."""
    request = pb.GenerateRequest(
        model=model,
        prompt=PROMPT,
        sampling=sampling_params(max_tokens=1, temperature=0.0),
        routing=routing_options(tier, pb.CACHE_POLICY_BYPASS),
    )
    started = time.perf_counter()
    call = client.generate_call(request, timeout_s=180)
    first: float | None = None
    try:
        async for frame in call:
            # A first token that ends the answer (end of sequence) comes only as the final's count.
            if first is None and (frame.token_ids or frame.text or frame.final.usage.completion_tokens):
                first = time.perf_counter() - started
    finally:
        call.cancel()
    if first is None:
        raise RuntimeError("the request ended without a token")
    return first


async def _stats(worker: worker_pb2_grpc.WorkerStub) -> worker_pb2.WorkerStats:
    stats: worker_pb2.WorkerStats = await worker.Stats(worker_pb2.StatsRequest(), metadata=INTERNAL, timeout=10)
    return stats


async def _sleep(worker: worker_pb2_grpc.WorkerStub, client: MeshClient, model: str = "") -> worker_pb2.ModelStateReply:
    """Puts the worker to sleep and waits until the router lists the model as not awake (bounded)."""
    reply: worker_pb2.ModelStateReply = await worker.Sleep(
        worker_pb2.SleepRequest(only_if_idle=False), metadata=INTERNAL, timeout=60
    )
    deadline = time.perf_counter() + 10
    while time.perf_counter() < deadline:
        models = {m.id: m for m in await client.list_models()}
        info = models.get(model) if model else next(iter(models.values()))
        if info is not None and info.state != "awake":
            break
        await asyncio.sleep(0.05)
    return reply


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _wakes(mesh: Mesh) -> float:
    """The router's ``meshserve_router_wakes_total`` summed over its labels (every router of the mesh)."""
    total = 0.0
    for name, url in mesh.metrics_urls().items():
        if not (name.startswith("gateway") or name.startswith("router")):
            continue
        total += sum(v for (metric, _), v in _scrape(url).items() if metric == "meshserve_router_wakes_total")
    return total


async def _by_model(mesh: Mesh) -> dict[str, tuple[str, worker_pb2_grpc.WorkerStub, grpc.aio.Channel]]:
    found = {}
    for proc in mesh.workers("edge") + mesh.workers("cloud"):
        channel = grpc.aio.insecure_channel(proc.address)
        stub = worker_pb2_grpc.WorkerStub(channel)
        stats = await _stats(stub)
        found[f"{proc.name.split('-')[0]}:{stats.model}"] = (proc.address, stub, channel)
    return found


def _anonymous_bytes(pid: int | None) -> int:
    """The process's anonymous resident bytes (/proc/PID/smaps_rollup): RSS less its file-backed pages
    (shared libraries' code and data, which the kernel may drop and read again); 0 when unknown."""
    if pid is None:
        return 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Anonymous:"))
    except (OSError, StopIteration, ValueError):
        return 0


async def _wake_pairs(
    client: MeshClient, worker: worker_pb2_grpc.WorkerStub, tier: str, rounds: int, pid: int | None = None
) -> dict[str, Any]:
    awake: list[float] = []
    asleep: list[float] = []
    rss_awake: list[int] = []
    rss_asleep: list[int] = []
    anon_awake: list[int] = []
    anon_asleep: list[int] = []
    await _ttft(client, tier)  # warm-up
    for i in range(rounds):
        awake.append(statistics.median([await _ttft(client, tier) for _ in range(3)]))
        rss_awake.append((await _stats(worker)).resident_bytes)
        anon_awake.append(_anonymous_bytes(pid))
        reply = await _sleep(worker, client)
        await asyncio.sleep(0.5)
        rss_asleep.append((await _stats(worker)).resident_bytes or reply.resident_bytes)
        anon_asleep.append(_anonymous_bytes(pid))
        asleep.append(await _ttft(client, tier))
        _log(f"{tier} round {i + 1}/{rounds}: awake {awake[-1]:.3f} s, asleep {asleep[-1]:.3f} s")
    return {
        "rounds": rounds,
        "awake_ttft_s": awake,
        "asleep_ttft_s": asleep,
        "awake_ttft_s_median": statistics.median(awake),
        "asleep_ttft_s_median": statistics.median(asleep),
        "extra_ttft_s": statistics.median(asleep) - statistics.median(awake),
        "resident_bytes_awake": int(statistics.median(rss_awake)),
        "resident_bytes_asleep": int(statistics.median(rss_asleep)),
        "anonymous_bytes_awake": int(statistics.median(anon_awake)),
        "anonymous_bytes_asleep": int(statistics.median(anon_asleep)),
    }


async def _burst(mesh: Mesh, client: MeshClient, worker: worker_pb2_grpc.WorkerStub, n: int) -> dict[str, Any]:
    await _sleep(worker, client)
    before = _wakes(mesh)
    results = await asyncio.gather(*(_ttft(client, "edge") for _ in range(n)), return_exceptions=True)
    await asyncio.sleep(1.0)
    wakes = _wakes(mesh) - before
    done = [r for r in results if isinstance(r, float)]
    errors = sorted({f"{type(r).__name__}: {r}"[:160] for r in results if not isinstance(r, float)})
    return {
        "requests": n,
        "completed": len(done),
        "wakes": wakes,
        "ttft_s_p50": percentile(done, 50) if done else None,
        "ttft_s_max": max(done) if done else None,
        "errors": errors,
    }


async def _steady(client: MeshClient, seconds: float, concurrency: int = 2) -> list[tuple[float, float]]:
    """(start, TTFT) of the default model's requests, ``concurrency`` closed loops for ``seconds``."""
    out: list[tuple[float, float]] = []
    end = time.perf_counter() + seconds

    async def loop() -> None:
        while (start := time.perf_counter()) < end:
            out.append((start, await _ttft(client, "edge")))

    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return out


async def _neighbours(
    client: MeshClient, other: worker_pb2_grpc.WorkerStub, seconds: float, blocks: int = 4
) -> dict[str, Any]:
    """The default model's TTFTs with no wake, and while the other model is put to sleep and woken
    again and again, in ``blocks`` alternating pairs of ``seconds / blocks`` each (so a drift of the
    shared host's speed falls on both alike); judged on the requests whose wait for a first token
    overlapped a wake (from the waking request's start to its first token)."""
    await _steady(client, 2.0)  # warm-up
    quiet: list[float] = []
    busy: list[tuple[float, float]] = []
    windows: list[tuple[float, float]] = []

    async def wake_again_and_again(stop: asyncio.Event) -> None:
        while not stop.is_set():
            await _sleep(other, client, OTHER_MODEL)
            await asyncio.sleep(0.2)  # the release's own CPU is not a wake's
            start = time.perf_counter()
            windows.append((start, start + await _ttft(client, "edge", OTHER_MODEL)))

    for _ in range(blocks):
        quiet += [ttft for _start, ttft in await _steady(client, seconds / blocks)]
        stop = asyncio.Event()
        waker = asyncio.create_task(wake_again_and_again(stop))
        try:
            busy += await _steady(client, seconds / blocks)
        finally:
            stop.set()
            await waker
        await asyncio.sleep(0.5)  # the last wake's first steps are not the next quiet block's
    during = [ttft for start, ttft in busy if any(a < start + ttft and start < b for a, b in windows)]
    if not during:
        raise RuntimeError("no request of the default model overlapped a wake of the other model")
    return {
        "seconds": seconds,
        "blocks": blocks,
        "quiet_requests": len(quiet),
        "cycling_requests": len(busy),
        "during_wakes_requests": len(during),
        "wakes_of_the_other_model": len(windows),
        "wake_s_median": statistics.median(b - a for a, b in windows),
        "quiet_ttft_s_p50": percentile(quiet, 50),
        "cycling_ttft_s_p50": percentile([t for _s, t in busy], 50),
        "during_wakes_ttft_s_p50": percentile(during, 50),
        "ratio": percentile(during, 50) / percentile(quiet, 50),
    }


async def _from_zero(rounds: int, idle_after_s: float, stop_after_s: float) -> dict[str, Any]:
    # No warm spare: "from zero processes" means no process of the model at all, imports included.
    config = _config(
        edge_workers=1,
        cloud_workers=0,
        supervise=True,
        warm_spares=False,
        min_replicas=0,
        idle_after_s=idle_after_s,
        stop_after_s=stop_after_s,
    )
    ttfts: list[float] = []
    async with Mesh(config, sink=lambda _n, _l: None) as mesh, MeshClient(mesh.gateway_address, DEV_API_KEY) as client:
        await _ttft(client, "edge")
        for i in range(rounds):
            deadline = time.perf_counter() + idle_after_s + stop_after_s + 60
            assert mesh.supervisor is not None
            while not all(mesh.supervisor.is_stopped(p.name) for p in mesh.workers("edge")):
                if time.perf_counter() > deadline:
                    raise RuntimeError("the scaler did not stop the idle edge worker")
                await asyncio.sleep(0.2)
            ttfts.append(await _ttft(client, "edge"))
            _log(f"from zero round {i + 1}/{rounds}: first token after {ttfts[-1]:.3f} s")
    return {"rounds": rounds, "ttft_s": ttfts, "ttft_s_median": statistics.median(ttfts), "ttft_s_max": max(ttfts)}


def sized_models_dir(shape: str) -> Path:
    """A models directory whose default model is a random-weight ``shape`` with SmolLM2's tokenizer,
    prepared as the default model is (``meshserve models prepare``: cloud checkpoint, INT4 edge graph,
    manifest); built on the first call (minutes), then reused."""
    import torch  # only here: the rest of the benchmark drives meshes and needs none

    models_dir = default_models_dir().parent / "bench-models" / f"random-{shape}"
    paths = model_paths(DEFAULT_MODEL_ID, models_dir)
    if read_manifest(paths) is not None and edge_complete(paths.edge_dir):
        return models_dir
    _log(f"preparing a random-weight {shape} model in {models_dir} (once: minutes)")
    source = models_dir / "source"
    shutil.rmtree(source, ignore_errors=True)
    try:
        build_checkpoint(shape, model_paths().hf_dir, source, torch.device("cpu"), torch.float32, stops=True)
        prepare(DEFAULT_MODEL_ID, models_dir, Source("hf_dir", str(source), f"random:{shape}"), show_progress=False)
    finally:
        shutil.rmtree(source, ignore_errors=True)
    return models_dir


async def _by_size(shape: str, rounds: int) -> dict[str, Any]:
    """The edge wake pairs of a mesh of one edge worker serving the random-weight ``shape``."""
    models_dir = await asyncio.to_thread(sized_models_dir, shape)
    config = _config(edge_workers=1, cloud_workers=0)
    config.extra_env["MESHSERVE_MODELS_DIR"] = str(models_dir)
    async with Mesh(config, sink=lambda _n, _l: None) as mesh, MeshClient(mesh.gateway_address, DEV_API_KEY) as client:
        proc = mesh.workers("edge")[0]
        async with grpc.aio.insecure_channel(proc.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            pairs = await _wake_pairs(client, stub, "edge", rounds, proc.proc.pid if proc.proc else None)
    return {"shape": shape, "parameters": parameters(shape), **pairs}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    edge_dir = str(model_paths().edge_dir)
    config = _config(edge_workers=1, cloud_workers=0, edge_models={OTHER_MODEL: edge_dir})
    _log("edge mesh: wake, memory, 64 at once, neighbours")
    async with Mesh(config, sink=lambda _n, _l: None) as mesh, MeshClient(mesh.gateway_address, DEV_API_KEY) as client:
        workers = await _by_model(mesh)
        try:
            default = next(v for k, v in workers.items() if k.startswith("edge:") and not k.endswith(OTHER_MODEL))
            other = workers[f"edge:{OTHER_MODEL}"]
            pid = next((p.proc.pid for p in mesh.workers("edge") if p.address == default[0] and p.proc), None)
            results["edge"] = await _wake_pairs(client, default[1], "edge", args.rounds, pid)
            results["burst"] = await _burst(mesh, client, default[1], args.burst)
            results["neighbours"] = await _neighbours(client, other[1], args.neighbour_seconds)
        finally:
            for _address, _stub, channel in workers.values():
                await channel.close()
    _log("cloud mesh: wake")
    async with (
        Mesh(_config(edge_workers=0, cloud_workers=1), sink=lambda _n, _l: None) as mesh,
        MeshClient(mesh.gateway_address, DEV_API_KEY) as client,
    ):
        cloud = mesh.workers("cloud")[0]
        async with grpc.aio.insecure_channel(cloud.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            pid = cloud.proc.pid if cloud.proc else None
            results["cloud"] = await _wake_pairs(client, stub, "cloud", args.rounds, pid)
    _log("from zero: stop policy")
    results["from_zero"] = await _from_zero(args.zero_rounds, args.idle_after_s, args.stop_after_s)
    for shape in args.sizes:
        _log(f"by size: a random-weight {shape} edge model")
        results.setdefault("sizes", []).append(await _by_size(shape, args.size_rounds))
    report: dict[str, Any] = {
        "benchmark": "wake",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_1m": os.getloadavg()[0]},
        "command": " ".join(["meshserve bench wake", *args.argv]),
        "results": results,
    }
    report["targets"] = targets(report)
    return report


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    r = report["results"]
    rows = []

    def row(name: str, value: float, unit: str, bound: str, ok: bool) -> None:
        rows.append({"name": name, "value": round(value, 3), "unit": unit, "bound": bound, "pass": ok})

    for tier in ("edge", "cloud"):
        if tier in r:
            extra, bound = r[tier]["extra_ttft_s"], TARGETS[f"{tier}_wake_extra_ttft_s"]
            row(f"{tier}_wake_extra_ttft", extra, "s", f"<= {bound:g} s", extra <= bound)
    if "edge" in r and r["edge"]["resident_bytes_awake"]:
        share = r["edge"]["resident_bytes_asleep"] / r["edge"]["resident_bytes_awake"]
        bound = TARGETS["edge_asleep_resident_share"]
        row("edge_asleep_resident_share", share, "x", f"<= {bound:g}x", share <= bound)
    if "from_zero" in r:
        got, bound = r["from_zero"]["ttft_s_max"], TARGETS["from_zero_ttft_s"]
        row("from_zero_first_token", got, "s", f"<= {bound:g} s", got <= bound)
    if "burst" in r:
        b = r["burst"]
        ok = b["completed"] == b["requests"] and b["wakes"] == 1
        rows.append(
            {
                "name": f"burst_{b['requests']}_at_a_sleeping_model",
                "value": f"{b['completed']}/{b['requests']} completed, {b['wakes']:g} wake(s)",
                "unit": "",
                "bound": f"{b['requests']} complete, exactly 1 wake",
                "pass": ok,
            }
        )
    if "neighbours" in r:
        ratio, bound = r["neighbours"]["ratio"], TARGETS["neighbour_ttft_p50_ratio"]
        row("neighbour_ttft_p50_during_wakes", ratio, "x", f"<= {bound:g}x the run with no wake", ratio <= bound)
    return rows


def markdown(report: dict[str, Any]) -> str:
    r = report["results"]
    lines = [
        "# Scale from zero: the first request to a sleeping or stopped model (issue 39)",
        "",
        f"{report['date']} · {report['machine']['cpus']} CPUs shared with other work (1-min load average "
        f"{report['machine']['load_avg_1m']:.2f} at the end) · `{report['command']}`",
        "",
        "Every figure is measured against the same model awake in the same run: TTFT of a short greedy "
        "prompt (1 token, response cache bypassed) through gateway → router → worker.",
        "",
        "```",
        *(target_line(t) for t in report["targets"]),
        "```",
        "",
        "| tier | rounds | TTFT awake (median) | TTFT asleep (median) | extra | RSS awake | RSS asleep "
        "| of which anonymous, awake | asleep |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for tier in ("edge", "cloud"):
        if tier in r:
            t = r[tier]
            lines.append(
                f"| {tier} | {t['rounds']} | {t['awake_ttft_s_median'] * 1000:.0f} ms | "
                f"{t['asleep_ttft_s_median'] * 1000:.0f} ms | {t['extra_ttft_s'] * 1000:.0f} ms | "
                f"{t['resident_bytes_awake'] / 2**20:.0f} MiB | {t['resident_bytes_asleep'] / 2**20:.0f} MiB | "
                f"{t.get('anonymous_bytes_awake', 0) / 2**20:.0f} MiB | "
                f"{t.get('anonymous_bytes_asleep', 0) / 2**20:.0f} MiB |"
            )
    lines += [
        "",
        "RSS asleep is what the issue asks the process to keep: the interpreter, its imports (onnxruntime or "
        "torch, numpy, grpc, tokenizers), the tokenizer and the servicer; the model's memory (graph session "
        "or weights, KV) is what a sleep gives back. Anonymous is RSS less the file-backed pages (the "
        "shared libraries' code and data: shared with the mesh's other processes that map them, and pages "
        "the kernel may drop under pressure and read again); the target counts RSS.",
    ]
    if r.get("sizes"):
        lines += [
            "",
            "**By model size** (no target of its own; the TARGET line is the default model's): the same edge "
            "pairs for random-weight models of larger shapes with SmolLM2's tokenizer (benchmarks/checkpoints.py), "
            "each prepared as the default model is (the INT4 edge graph) and served by a mesh of its own in this run.",
            "",
            "| edge model | parameters | rounds | RSS awake | RSS asleep | asleep / awake | anonymous, awake | asleep "
            "| extra TTFT |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        sized = [("the default model (SmolLM2-135M)", parameters("135m"), r["edge"])] if "edge" in r else []
        sized += [(f"random, {t['shape']} shape", t["parameters"], t) for t in r["sizes"]]
        for name, count, t in sized:
            awake, asleep = t["resident_bytes_awake"], t["resident_bytes_asleep"]
            lines.append(
                f"| {name} | {count / 1e6:,.0f} M | {t['rounds']} | {awake / 2**20:,.0f} MiB | "
                f"{asleep / 2**20:,.0f} MiB | {asleep / awake if awake else 0:.3f}x | "
                f"{t.get('anonymous_bytes_awake', 0) / 2**20:,.0f} MiB | "
                f"{t.get('anonymous_bytes_asleep', 0) / 2**20:,.0f} MiB | {t['extra_ttft_s'] * 1000:.0f} ms |"
            )
    if "burst" in r:
        b = r["burst"]
        lines += [
            "",
            f"**{b['requests']} at once at a sleeping edge model:** {b['completed']} completed, "
            f"{b['wakes']:g} wake(s) counted by the router; TTFT p50 "
            f"{(b['ttft_s_p50'] or 0) * 1000:.0f} ms, max {(b['ttft_s_max'] or 0) * 1000:.0f} ms."
            + (f" Errors: {'; '.join(b['errors'])}" if b["errors"] else ""),
        ]
    if "neighbours" in r:
        n = r["neighbours"]
        lines += [
            "",
            f"**Neighbours:** the default model's TTFT p50 (2 closed loops, {n['seconds']:g} s each run, in "
            f"{n.get('blocks', 1)} alternating blocks of each) "
            f"{n['quiet_ttft_s_p50'] * 1000:.1f} ms with no wake ({n['quiet_requests']} requests), "
            f"{n['during_wakes_ttft_s_p50'] * 1000:.1f} ms for the {n['during_wakes_requests']} requests that "
            f"waited for their first token while `{OTHER_MODEL}` woke ({n['wakes_of_the_other_model']} wakes, "
            f"median {n['wake_s_median'] * 1000:.0f} ms each, the model put back to sleep between them): "
            f"{n['ratio']:.3f}x. Over the whole run of sleeps and wakes ({n['cycling_requests']} requests): "
            f"{n['cycling_ttft_s_p50'] * 1000:.1f} ms.",
        ]
    if "from_zero" in r:
        z = r["from_zero"]
        lines += [
            "",
            "**From zero processes** (`min_replicas: 0`, stop policy; the scaler of `meshserve up` starts the "
            "worker when the router holds a request): first token after "
            + ", ".join(f"{s:.2f} s" for s in z["ttft_s"])
            + f" (median {z['ttft_s_median']:.2f} s).",
        ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshserve bench wake", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="awake/asleep pairs per tier (default 5)")
    parser.add_argument("--burst", type=int, default=64, help="requests at once at a sleeping model (default 64)")
    parser.add_argument("--neighbour-seconds", type=float, default=20.0, help="each neighbours run (default 20)")
    parser.add_argument("--zero-rounds", type=int, default=3, help="requests from zero processes (default 3)")
    parser.add_argument("--idle-after-s", type=float, default=1.0, help="from zero: idle_after_s (default 1)")
    parser.add_argument("--stop-after-s", type=float, default=3.0, help="from zero: stop_after_s (default 3)")
    parser.add_argument(
        "--sizes",
        nargs="*",
        default=list(SIZES),
        choices=sorted(SHAPES),
        help="random-weight shapes whose edge memory awake and asleep the report adds, each in a mesh of its own "
        f"(default {' '.join(SIZES)}; none: --sizes with no shape)",
    )
    parser.add_argument("--size-rounds", type=int, default=3, help="awake/asleep pairs per size (default 3)")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"), help="output directory")
    args = parser.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    report = asyncio.run(run(args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "wake.json").write_text(json.dumps(report, indent=2) + "\n")
    earlier_runs.write(args.out / "wake.md", markdown(report))
    for row in report["targets"]:
        print(target_line(row))
    return 0 if all(row["pass"] for row in report["targets"]) else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
