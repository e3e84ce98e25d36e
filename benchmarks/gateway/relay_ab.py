"""``meshserve bench relay --ab-tree TREE``: tokens relayed per second by two source trees, in one run.

Per worker mode (paced, judged; instant), two meshes (:mod:`benchmarks.gateway.tree_mesh`): side ``a`` from
this tree, side ``b`` from TREE (e.g. ``git worktree add /tmp/before 04ec40b``; TREE = this tree
gives an A/A run, the noise of the measure). Each: its own redis-server, its tree's instant worker,
router + gateway (split layout) and a gateway with the router embedded (the default layout). Each
round runs every (tree, path) once for ``--duration`` seconds, closed loop at ``--streams``, in a
seeded-random order, so both trees see the same machine load. Reports per tree the median tok/s of
the rounds, frames per token, e2e p50, and the hops' CPU ms per 1,000 relayed tokens; writes
relay_ab.json/.md.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import platform
import random
import statistics
import sys
import tempfile
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import grpc

from benchmarks import earlier_runs
from benchmarks.gateway.relay_measure import TARGET_TOKENS_PER_S, measure
from benchmarks.gateway.tree_mesh import TreeMesh, describe, same_services, start_mesh, tree_text
from benchmarks.load.generator import Sender
from benchmarks.load.senders import grpc_sender, worker_sender
from services.cli.client import MeshClient
from services.common.model_paths import model_paths
from services.common.pb.meshserve.internal.v1 import worker_pb2_grpc
from services.common.tokenizer import Tokenizer
from services.local.mesh import DEV_API_KEY

SIDES = ("a", "b")
PATHS = {
    "direct_worker": "straight to its tree's worker (internal API)",
    "gateway_router": "gateway process -> router process -> worker (split layout)",
    "gateway_embedded_router": "the gateway with the router in its process (`meshserve up`'s default) -> worker",
}
HOPS = {"direct_worker": (), "gateway_router": ("gateway", "router"), "gateway_embedded_router": ("gateway_embedded",)}


async def _senders(mesh: TreeMesh, side: str, stack: AsyncExitStack, tokenizer: Tokenizer) -> dict[str, Sender]:
    def address(name: str) -> str:
        return mesh.procs[f"{name}_{side}"].address

    channel = await stack.enter_async_context(grpc.aio.insecure_channel(address("worker")))
    split = await stack.enter_async_context(MeshClient(address("gateway"), DEV_API_KEY))
    embedded = await stack.enter_async_context(MeshClient(address("gateway_embedded"), DEV_API_KEY))
    return {
        "direct_worker": worker_sender(worker_pb2_grpc.WorkerStub(channel), tokenizer.encode),
        "gateway_router": grpc_sender(split),
        "gateway_embedded_router": grpc_sender(embedded),
    }


async def _run_mode(
    tree: Path, streams: int, max_tokens: int, duration: float, rounds: int, interval_ms: float
) -> tuple[dict[str, dict[str, list[dict[str, Any]]]], list[str]]:
    tmp = tempfile.TemporaryDirectory(prefix="meshserve-relay-ab-")
    slots = str(max(64, streams))
    worker_settings = {
        "MESHSERVE_INSTANT_WORKER_MAX_ACTIVE_SEQUENCES": slots,
        "MESHSERVE_INSTANT_WORKER_MAX_QUEUE": slots,
        "MESHSERVE_INSTANT_WORKER_TOKEN_INTERVAL_MS": str(interval_ms),
    }
    gateway_settings = {"MESHSERVE_GATEWAY_MAX_CONCURRENT_STREAMS": "4096"}
    meshes: dict[str, TreeMesh] = {}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {side: {name: [] for name in PATHS} for side in SIDES}
    try:
        for side, source in zip(SIDES, (None, tree), strict=True):
            meshes[side] = await start_mesh(
                tmp.name, source, worker_settings=worker_settings, gateway_settings=gateway_settings, suffix=f"_{side}"
            )
        pids = {name: pid for mesh in meshes.values() for name, pid in mesh.pids().items()} | {"client": os.getpid()}
        tokenizer = Tokenizer(model_paths().hf_dir)
        async with AsyncExitStack() as stack:
            senders = {side: await _senders(mesh, side, stack, tokenizer) for side, mesh in meshes.items()}
            order = [(side, name) for side in SIDES for name in PATHS]
            for side, name in order:  # warm up
                await measure(senders[side][name], streams, max_tokens, 2.0, pids)
            rng = random.Random(7)
            for i in range(rounds):
                rng.shuffle(order)
                for side, name in order:
                    got = await measure(senders[side][name], streams, max_tokens, duration, pids)
                    cpu = got["cpu_ms_per_1k_tokens"]
                    got["cpu_ms_per_1k_tokens"] = {"client": cpu["client"]} | {
                        n.removesuffix(f"_{side}"): ms for n, ms in cpu.items() if n.endswith(f"_{side}")
                    }
                    runs[side][name].append(got)
                    print(
                        f"[interval {interval_ms:g} ms] round {i + 1}/{rounds} {side} {name}: "
                        f"{got['tokens_per_s']:.0f} tok/s",
                        file=sys.stderr,
                    )
    finally:
        for mesh in meshes.values():
            await mesh.stop()
        tmp.cleanup()
    return runs, [note for mesh in meshes.values() for note in mesh.notes]


def _medians(runs: list[dict[str, Any]], hops: tuple[str, ...]) -> dict[str, float]:
    return {
        "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in runs), 1),
        "frames_per_token": round(statistics.median(r["frames_per_token"] for r in runs), 3),
        "e2e_ms_p50": round(statistics.median(r["e2e_ms_p50"] for r in runs), 2),
        "hops_cpu_ms_per_1k_tokens": round(
            statistics.median(sum(r["cpu_ms_per_1k_tokens"].get(h, 0.0) for h in hops) for r in runs), 1
        ),
    }


async def run(
    tree: Path, streams: int, max_tokens: int, duration: float, rounds: int, token_interval_ms: float = 5.0
) -> dict[str, Any]:
    """``tree``: a checked root of a meshserve source tree (:func:`benchmarks.gateway.tree_mesh.check_tree`)."""
    modes: dict[str, Any] = {}
    notes: list[str] = []
    for mode, interval in (("paced", token_interval_ms), ("instant", 0.0)):
        runs, notes = await _run_mode(tree, streams, max_tokens, duration, rounds, interval)
        modes[mode] = {
            "token_interval_ms": interval,
            "offered_tokens_per_s": round(streams * 1000.0 / interval) if interval else None,
            "medians": {side: {n: _medians(rs, HOPS[n]) for n, rs in runs[side].items()} for side in SIDES},
            "runs": runs,
        }
    trees = {"a": await asyncio.to_thread(describe, None), "b": await asyncio.to_thread(describe, tree)}
    return {
        "benchmark": "relay_ab",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_1m": os.getloadavg()[0]},
        "command": f"meshserve bench relay --ab-tree {tree} --streams {streams} --max-tokens {max_tokens} "
        f"--duration {duration:g} --rounds {rounds} --token-interval-ms {token_interval_ms:g}",
        "trees": trees,
        "a_a": same_services(trees["a"], trees["b"]),
        "streams": streams,
        "max_tokens": max_tokens,
        "target_tokens_per_s": TARGET_TOKENS_PER_S,
        "notes": notes,
        "modes": modes,
    }


def markdown(report: dict[str, Any]) -> str:
    trees = report["trees"]
    kind = (
        "A/A: both sides run the same service code, so every difference below is the measure's noise"
        if report["a_a"]
        else "A/B: two source trees"
    )
    lines = [
        "# Tokens relayed per second, two source trees side by side in one run",
        "",
        f"{report['date']} · {report['machine']['cpus']} CPUs shared by the client and both meshes (1-min load "
        f"average {report['machine']['load_avg_1m']:.2f} at the end) · `{report['command']}`",
        "",
        f"{kind}. Side a: {tree_text(trees['a'])}; side b: {tree_text(trees['b'])}.",
        "Each side is a whole mesh of its tree's code (benchmarks/gateway/tree_mesh.py); every round runs each "
        "(tree, path)",
        "once, in a seeded-random order.",
        f"{report['streams']} concurrent greedy streams of {report['max_tokens']} tokens; medians of the rounds.",
        f"Target (through gateway + router, paced): >= {report['target_tokens_per_s']:,.0f} tok/s.",
    ]
    for name, mode in report["modes"].items():
        if mode["token_interval_ms"]:
            title = (
                f"## {name.capitalize()} (judged): one token per {mode['token_interval_ms']:g} ms per stream, "
                f"{mode['offered_tokens_per_s']:,} tok/s offered"
            )
        else:
            title = f"## {name.capitalize()}: tokens at once"
        a, b = mode["medians"]["a"], mode["medians"]["b"]
        lines += [
            "",
            title,
            "",
            "| path | tok/s a / b | b / a | frames/token a / b | e2e p50 ms a / b | hops' CPU ms per 1k tokens a / b |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for path in a:
            x, y = a[path], b[path]
            ratio = f"{y['tokens_per_s'] / x['tokens_per_s']:.3f}" if x["tokens_per_s"] else ""
            cpu = (
                f"{x['hops_cpu_ms_per_1k_tokens']:.0f} / {y['hops_cpu_ms_per_1k_tokens']:.0f}" if HOPS.get(path) else ""
            )
            lines.append(
                f"| {path} | {x['tokens_per_s']:,.0f} / {y['tokens_per_s']:,.0f} | {ratio} | "
                f"{x['frames_per_token']:.2f} / {y['frames_per_token']:.2f} | "
                f"{x['e2e_ms_p50']:.1f} / {y['e2e_ms_p50']:.1f} | {cpu} |"
            )
    lines += ["", "Paths: " + "; ".join(f"`{name}`: {what}" for name, what in PATHS.items()) + "."]
    lines += [f"\n{note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "relay_ab.json").write_text(json.dumps(report, indent=2) + "\n")
    earlier_runs.write(out / "relay_ab.md", markdown(report))
