"""``python -m benchmarks.gateway.hops --ab-tree TREE``: the hops of two source trees side by side, in one run.

Two meshes (:mod:`benchmarks.gateway.tree_mesh`), side ``a`` from this tree and side ``b`` from TREE (e.g.
``git worktree add /tmp/before 04ec40b``; TREE = this tree gives an A/A run, the noise of the
measure). Each mesh: its own redis-server, its tree's instant worker (tokens at once), router +
gateway (split layout) and a gateway with the router embedded (``meshserve up``'s default layout).

1. **Added latency, paired and interleaved** (:func:`benchmarks.gateway.hops_pairs.ab_paired`): each path in
   turn; per round both meshes in a random order, each running one request through the path and one
   straight to its own worker (in a random order). Added = path minus its own tree's direct call;
   also the median of the per-pair differences (the measure of the earlier A/B work, docs/gateway.md).
2. **CPU per request, by process**: blocks of 10 requests per path and tree in turn, each process's
   CPU time (/proc schedstat) around each block.
3. **Exact cache hit**: TTFT of a cached greedy request through each tree's router and gateways,
   round robin over both trees in a seeded order.

Writes hops_ab.json/.md. Requests use this tree's protobuf messages against both meshes (the wire
format of the public and worker APIs is the same in both trees, or the run fails loudly).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import grpc

from benchmarks import earlier_runs
from benchmarks.gateway.hop_timing import INTERNAL, PROMPT, cpu_per_request, latency_samples, stream_call, worker_call
from benchmarks.gateway.hops_pairs import Probe, ab_paired, summary
from benchmarks.gateway.tree_mesh import TreeMesh, describe, same_services, start_mesh, tree_text
from services.common.model_paths import model_paths
from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.tokenizer import Tokenizer
from services.local.mesh import DEV_API_KEY

SIDES = ("a", "b")
PATHS = {
    "direct_worker": "the client calls its tree's worker's internal Generate itself (the baseline)",
    "router": "the router process -> worker (internal API)",
    "gateway_static_key": "gateway process -> router process -> worker (`meshserve up --split-router`)",
    "gateway_embedded_router": "the gateway with the router in its process (`meshserve up`'s default) -> worker",
}


def _probes(
    mesh: TreeMesh, side: str, channels: list[grpc.aio.Channel], ids: list[int], max_tokens: int, cached: bool
) -> dict[str, Probe]:
    """One side's paths; the channels it opens are appended to ``channels`` (the caller closes them)."""

    def channel(name: str) -> grpc.aio.Channel:
        channels.append(grpc.aio.insecure_channel(mesh.procs[f"{name}_{side}"].address))
        return channels[-1]

    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    policy = pb.CACHE_POLICY_USE if cached else pb.CACHE_POLICY_BYPASS
    request = pb.GenerateRequest(
        prompt=PROMPT, sampling=sampling, routing=pb.RoutingOptions(tier=pb.TIER_EDGE, cache_policy=policy)
    )
    start = worker_pb2.WorkerRequest(
        start=worker_pb2.WorkerStart(request_id="bench", prompt_token_ids=ids, sampling=sampling)
    )
    worker = worker_pb2_grpc.WorkerStub(channel("worker"))
    router = inference_pb2_grpc.InferenceStub(channel("router"))
    gateway = inference_pb2_grpc.InferenceStub(channel("gateway"))
    embedded = inference_pb2_grpc.InferenceStub(channel("gateway_embedded"))
    static = (("authorization", f"Bearer {DEV_API_KEY}"),)
    probes: dict[str, Probe] = {} if cached else {"direct_worker": lambda: worker_call(worker, start)}
    probes["router"] = lambda: stream_call(router.Generate(request, metadata=INTERNAL))
    probes["gateway_static_key"] = lambda: stream_call(gateway.Generate(request, metadata=static))
    probes["gateway_embedded_router"] = lambda: stream_call(embedded.Generate(request, metadata=static))
    return probes


async def run(tree: Path, requests: int = 300, cpu_requests: int = 200, max_tokens: int = 16) -> dict[str, Any]:
    """``tree``: a checked root of a meshserve source tree (:func:`benchmarks.gateway.tree_mesh.check_tree`)."""
    tmp = tempfile.TemporaryDirectory(prefix="meshserve-hops-ab-")
    worker_settings = {"MESHSERVE_INSTANT_WORKER_MAX_ACTIVE_SEQUENCES": "8"}
    meshes: dict[str, TreeMesh] = {}
    channels: list[grpc.aio.Channel] = []
    try:
        for side, source in zip(SIDES, (None, tree), strict=True):
            meshes[side] = await start_mesh(tmp.name, source, worker_settings=worker_settings, suffix=f"_{side}")
        ids = Tokenizer(model_paths().hf_dir).encode(PROMPT)
        probes = {side: _probes(mesh, side, channels, ids, max_tokens, cached=False) for side, mesh in meshes.items()}
        pairs = await ab_paired(probes, "direct_worker", requests)
        pids = {name: pid for mesh in meshes.values() for name, pid in mesh.pids().items()} | {"client": os.getpid()}
        flat = {f"{side}: {name}": probe for side, ps in probes.items() for name, probe in ps.items()}
        cpu = await cpu_per_request(flat, pids, cpu_requests)
        hit_probes = {
            side: _probes(mesh, side, channels, ids, max_tokens, cached=True) for side, mesh in meshes.items()
        }
        hit_flat = {f"{side}: {name}": probe for side, ps in hit_probes.items() for name, probe in ps.items()}
        hits = await latency_samples(hit_flat, requests, warmup=10)
    finally:
        for channel in channels:
            await channel.close()
        for mesh in meshes.values():
            await mesh.stop()
        tmp.cleanup()
    trees = {"a": await asyncio.to_thread(describe, None), "b": await asyncio.to_thread(describe, tree)}
    return {
        "benchmark": "hops_ab",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_avg_1m": os.getloadavg()[0],
        },
        "command": f"python -m benchmarks.gateway.hops --ab-tree {tree} --requests {requests} "
        f"--cpu-requests {cpu_requests} "
        f"--max-tokens {max_tokens}",
        "trees": trees,
        "a_a": same_services(trees["a"], trees["b"]),
        "max_tokens": max_tokens,
        "notes": [note for mesh in meshes.values() for note in mesh.notes],
        "paired": pairs,
        "cpu_ms_per_request": {
            side: {name: _side_cpu(cpu[f"{side}: {name}"], side) for name in probes[side]} for side in SIDES
        },
        "cache_hit": {
            side: {name: summary(hits[f"{side}: {name}"], None) for name in hit_probes[side]} for side in SIDES
        },
    }


def _side_cpu(row: dict[str, float], side: str) -> dict[str, float]:
    """The CPU row of one side's path: its own processes (suffix dropped) and the client."""
    out = {"client": row["client"]}
    out |= {name.removesuffix(f"_{side}"): ms for name, ms in row.items() if name.endswith(f"_{side}")}
    return out


def _change(a: float, b: float) -> str:
    return f"{b - a:+.2f}"


def markdown(report: dict[str, Any]) -> str:
    trees = report["trees"]
    kind = (
        "A/A: both sides run the same service code, so every difference below is the measure's noise"
        if report["a_a"]
        else ("A/B: two source trees")
    )
    lines = [
        "# Hop overhead, two source trees side by side in one run",
        "",
        f"{report['date']} · {report['machine']['cpus']} CPUs (shared with other work; 1-min load average "
        f"{report['machine']['load_avg_1m']:.1f} at the end), Python {report['machine']['python']} · "
        f"`{report['command']}`",
        "",
        f"{kind}. Side a: {tree_text(trees['a'])}; side b: {tree_text(trees['b'])}.",
        "Each side is a whole mesh of its tree's code (its own redis-server, instant worker, router, gateway,",
        "gateway with the router embedded: benchmarks/gateway/tree_mesh.py).",
        f"Greedy requests of {report['max_tokens']} tokens, response cache bypassed.",
        "",
        "## Added over each tree's own direct worker call (ms): paired, both trees interleaved",
        "",
        "Each path in turn; per round both meshes in a random order, each running one request through the path",
        "and one to its own worker (random order within the pair). `pair median` = median of the per-pair TTFT",
        "differences; `added` = p50 (p99) of the path minus p50 (p99) of its own direct calls.",
        "",
        "| path | direct TTFT p50 a / b | added TTFT p50 a / b | b - a | pair median a / b | b - a "
        "| added TTFT p99 a / b | added total p50 a / b |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    pa, pb_ = report["paired"]["a"], report["paired"]["b"]
    for name in pa:
        a, b = pa[name], pb_[name]
        lines.append(
            f"| {name} | {a['base_ttft_p50_ms']:.2f} / {b['base_ttft_p50_ms']:.2f} | "
            f"{a['added_ttft_p50_ms']:+.2f} / {b['added_ttft_p50_ms']:+.2f} | "
            f"**{_change(a['added_ttft_p50_ms'], b['added_ttft_p50_ms'])}** | "
            f"{a['pair_ttft_p50_ms']:+.2f} / {b['pair_ttft_p50_ms']:+.2f} | "
            f"{_change(a['pair_ttft_p50_ms'], b['pair_ttft_p50_ms'])} | "
            f"{a['added_ttft_p99_ms']:+.2f} / {b['added_ttft_p99_ms']:+.2f} | "
            f"{a['added_total_p50_ms']:+.2f} / {b['added_total_p50_ms']:+.2f} |"
        )
    lines += ["", "## CPU ms per request, by process (cache bypassed)", ""]
    cpu_a, cpu_b = report["cpu_ms_per_request"]["a"], report["cpu_ms_per_request"]["b"]
    procs = ["client", "gateway", "router", "gateway_embedded", "worker", "redis"]
    lines += ["| path | " + " | ".join(f"{p} a / b" for p in procs) + " |", "|---|" + "---:|" * len(procs)]
    for name in cpu_a:
        cells = [f"{cpu_a[name].get(p, 0.0):.2f} / {cpu_b[name].get(p, 0.0):.2f}" for p in procs]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Exact cache hit (greedy, response cache on): TTFT ms, both trees in one round robin",
        "",
        "| path | TTFT p50 a / b | b - a | TTFT p99 a / b |",
        "|---|---:|---:|---:|",
    ]
    ha, hb = report["cache_hit"]["a"], report["cache_hit"]["b"]
    for name in ha:
        a, b = ha[name], hb[name]
        lines.append(
            f"| {name} | {a['ttft_p50_ms']:.2f} / {b['ttft_p50_ms']:.2f} | "
            f"{_change(a['ttft_p50_ms'], b['ttft_p50_ms'])} | {a['ttft_p99_ms']:.2f} / {b['ttft_p99_ms']:.2f} |"
        )
    lines += ["", "Paths: " + "; ".join(f"`{name}`: {what}" for name, what in PATHS.items()) + "."]
    lines += [f"\n{note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "hops_ab.json").write_text(json.dumps(report, indent=2) + "\n")
    earlier_runs.write(out / "hops_ab.md", markdown(report))
