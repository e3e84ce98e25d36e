"""``meshserve bench worker-runtime --ab-tree TREE``: the worker runtime alone, this tree's vs TREE's,
in one run (issue 37).

**In-process** (per stream count, 1 / 16 / 64 / 256 by default, 256 tokens each): each round runs both
trees once, in alternating order, each in a fresh process (benchmarks/worker/runtime_side.py: the
tree's own ``Runner`` over a zero-cost engine; this tree's engine loop over a batched engine that
advances every live sequence one token per step; the runtime before it over a lockstep engine whose
sequences all wait for one shared zero-cost batch step, as both real engines' did), and the floor: a
bare loop of the per-token work (detokenize, stop check) for the same rows. Reported: tokens/s and
runtime milliseconds per step (wall time / engine steps), medians of the rounds.

**Through the service** (``--service``, 64 streams): the same zero-cost engine in a real worker process
of each tree (its instant worker, benchmarks/gateway/instant_worker.py), reached over the router's
stream transport from a real gateway with the router embedded (``meshserve up``'s default layout),
closed loop, interleaved rounds (benchmarks/gateway/relay_ab.py's meshes); with each process's CPU per
1,000 tokens (where the time goes).

TARGET lines go to docs/benchmarks/worker_runtime.md (and stdout): at 64 streams >= 5x the old
runtime's tok/s and <= 0.75 ms per step; at 256 >= 10x and <= 3 ms per step; through the service at
64 streams >= 2x the old tree's tok/s.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.gateway.tree_mesh import check_tree, describe, tree_text
from benchmarks.report import target_line
from services.common.model_paths import model_paths

SIDE = Path(__file__).with_name("runtime_side.py")
TARGETS = {
    64: {"speedup": 5.0, "ms_per_step": 0.75},
    256: {"speedup": 10.0, "ms_per_step": 3.0},
}
SERVICE_STREAMS = 64
SERVICE_SPEEDUP = 2.0
LONE_STEP_MS = (2.0, 10.0)
"""Model time per step of the lone-stream measure: a GPU's 64-row step, an edge CPU step."""
LONE_OVERHEAD_MS = 0.2


def _side(tree: Path, streams: int, tokens: int, repeats: int, floor: bool, step_ms: float = 0.0) -> dict[str, Any]:
    cmd = [sys.executable, "-P", str(SIDE), "--tree", str(tree), "--tokenizer-dir", str(model_paths().hf_dir)]
    cmd += ["--streams", str(streams), "--tokens", str(tokens), "--repeats", str(repeats)]
    if floor:
        cmd.append("--floor")
    if step_ms:
        cmd += ["--step-ms", str(step_ms)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"the runtime side for {tree} at {streams} streams failed:\n{done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def in_process(tree: Path, streams: Sequence[int], tokens: int, rounds: int, repeats: int) -> dict[str, Any]:
    here = Path.cwd().resolve()
    out: dict[str, Any] = {}
    for n in streams:
        runs: dict[str, list[dict[str, Any]]] = {"new": [], "old": [], "floor": []}
        for r in range(rounds):
            order = [("new", here), ("old", tree)] if r % 2 == 0 else [("old", tree), ("new", here)]
            for name, source in order:
                got = _side(source, n, tokens, repeats, floor=name == "new")
                if name == "new":
                    runs["floor"].append(got.pop("floor"))
                runs[name].append(got)
                print(
                    f"[{n} streams] round {r + 1}/{rounds} {name} ({got['runtime']}): "
                    f"{got['tokens_per_s']:,.0f} tok/s, {got['ms_per_step']:.3f} ms/step",
                    file=sys.stderr,
                )
        medians = {
            name: {
                "tokens_per_s": statistics.median(x["tokens_per_s"] for x in rs),
                "ms_per_step": statistics.median(x["ms_per_step"] for x in rs),
            }
            for name, rs in runs.items()
        }
        out[str(n)] = {"medians": medians, "runs": runs}
    return out


def lone_stream(tree: Path, tokens: int, rounds: int) -> dict[str, Any]:
    """One stream over an engine whose step takes ``ms`` of GIL-free model time: what each step costs
    beyond the model call (the inter-token time minus the model step), per tree."""
    here = Path.cwd().resolve()
    out: dict[str, Any] = {}
    for ms in LONE_STEP_MS:
        runs: dict[str, list[float]] = {"new": [], "old": []}
        for r in range(rounds):
            order = [("new", here), ("old", tree)] if r % 2 == 0 else [("old", tree), ("new", here)]
            for name, source in order:
                got = _side(source, 1, tokens, 1, floor=False, step_ms=ms)
                runs[name].append(got["overhead_ms_per_step"])
                print(f"[lone stream, {ms:g} ms steps] {name}: +{got['overhead_ms_per_step']:.3f} ms", file=sys.stderr)
        out[f"{ms:g}"] = {"overhead_ms": {n: statistics.median(v) for n, v in runs.items()}, "runs": runs}
    return out


async def through_service(tree: Path, tokens: int, duration: float, rounds: int) -> dict[str, Any]:
    """Both trees' meshes (redis, worker process, gateway with the router embedded), interleaved rounds."""
    import random
    import tempfile
    from contextlib import AsyncExitStack

    from benchmarks.gateway.relay_measure import measure
    from benchmarks.gateway.tree_mesh import start_mesh
    from benchmarks.load.senders import grpc_sender
    from services.cli.client import MeshClient
    from services.local.mesh import DEV_API_KEY

    tmp = tempfile.TemporaryDirectory(prefix="meshserve-worker-runtime-")
    slots = str(max(64, SERVICE_STREAMS))
    worker_settings = {
        "MESHSERVE_INSTANT_WORKER_MAX_ACTIVE_SEQUENCES": slots,
        "MESHSERVE_INSTANT_WORKER_MAX_QUEUE": slots,
    }
    gateway_settings = {"MESHSERVE_GATEWAY_MAX_CONCURRENT_STREAMS": "4096"}
    lockstep = [sys.executable, "-P", str(SIDE.with_name("lockstep_worker.py"))]
    meshes = {}
    runs: dict[str, list[dict[str, Any]]] = {"new": [], "old": []}
    try:
        meshes["new"] = await start_mesh(
            tmp.name,
            None,
            layouts=("embedded",),
            worker_settings=worker_settings,
            gateway_settings=gateway_settings,
            suffix="_new",
        )
        meshes["old"] = await start_mesh(
            tmp.name,
            tree,
            layouts=("embedded",),
            worker_settings=worker_settings,
            gateway_settings=gateway_settings,
            suffix="_old",
            worker_argv=lockstep,
        )
        pids = {name: pid for mesh in meshes.values() for name, pid in mesh.pids().items()} | {"client": os.getpid()}
        async with AsyncExitStack() as stack:
            senders = {}
            for side, mesh in meshes.items():
                address = mesh.procs[f"gateway_embedded_{side}"].address
                client = await stack.enter_async_context(MeshClient(address, DEV_API_KEY))
                senders[side] = grpc_sender(client)
            for side in senders:  # warm up
                await measure(senders[side], SERVICE_STREAMS, tokens, 2.0, pids)
            order = list(senders)
            rng = random.Random(7)
            for i in range(rounds):
                rng.shuffle(order)
                for side in order:
                    got = await measure(senders[side], SERVICE_STREAMS, tokens, duration, pids)
                    got["cpu_ms_per_1k_tokens"] = {"client": got["cpu_ms_per_1k_tokens"]["client"]} | {
                        n.removesuffix(f"_{side}"): ms
                        for n, ms in got["cpu_ms_per_1k_tokens"].items()
                        if n.endswith(f"_{side}")
                    }
                    runs[side].append(got)
                    print(f"[service] round {i + 1}/{rounds} {side}: {got['tokens_per_s']:,.0f} tok/s", file=sys.stderr)
    finally:
        for mesh in meshes.values():
            await mesh.stop()
        tmp.cleanup()
    medians = {
        side: {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
            "frames_per_token": statistics.median(r["frames_per_token"] for r in rs),
            "e2e_ms_p50": statistics.median(r["e2e_ms_p50"] for r in rs),
        }
        for side, rs in runs.items()
    }
    cpu = {
        side: {
            proc: statistics.median(r["cpu_ms_per_1k_tokens"].get(proc, 0.0) for r in rs)
            for proc in ("client", "worker", "gateway_embedded")
        }
        for side, rs in runs.items()
    }
    notes = [note for mesh in meshes.values() for note in mesh.notes]
    return {"streams": SERVICE_STREAMS, "medians": medians, "cpu_ms_per_1k_tokens": cpu, "runs": runs, "notes": notes}


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for n, bound in TARGETS.items():
        got = report["in_process"].get(str(n))
        if got is None:
            continue
        m = got["medians"]
        speedup = m["new"]["tokens_per_s"] / m["old"]["tokens_per_s"]
        rows.append(
            {
                "name": f"worker_runtime_{n}_streams_vs_old",
                "value": round(speedup, 2),
                "unit": "x",
                "bound": f">= {bound['speedup']:g}x",
                "pass": speedup >= bound["speedup"],
            }
        )
        ms = m["new"]["ms_per_step"]
        rows.append(
            {
                "name": f"worker_runtime_{n}_streams_ms_per_step",
                "value": round(ms, 3),
                "unit": "ms",
                "bound": f"<= {bound['ms_per_step']:g} ms",
                "pass": ms <= bound["ms_per_step"],
            }
        )
    for ms, got in report.get("lone_stream", {}).items():
        over = got["overhead_ms"]["new"]
        rows.append(
            {
                "name": f"worker_runtime_lone_stream_{ms}ms_steps_overhead",
                "value": round(over, 3),
                "unit": "ms",
                "bound": f"<= {LONE_OVERHEAD_MS:g} ms",
                "pass": over <= LONE_OVERHEAD_MS,
            }
        )
    service = report.get("service")
    if service is not None:
        a, b = service["medians"]["new"]["tokens_per_s"], service["medians"]["old"]["tokens_per_s"]
        ratio = a / b if b else 0.0
        rows.append(
            {
                "name": f"worker_runtime_service_{SERVICE_STREAMS}_streams_vs_old",
                "value": round(ratio, 2),
                "unit": "x",
                "bound": f">= {SERVICE_SPEEDUP:g}x",
                "pass": ratio >= SERVICE_SPEEDUP,
            }
        )
    return rows


def markdown(report: dict[str, Any]) -> str:
    trees = report["trees"]
    lines = [
        "# The worker runtime alone: the engine loop vs the thread per sequence (issue 37)",
        "",
        f"{report['date']} · {report['machine']['cpus']} CPUs (1-min load average "
        f"{report['machine']['load_avg_1m']:.2f} at the end) · `{report['command']}`",
        "",
        f"New: {tree_text(trees['new'])}; old: {tree_text(trees['old'])}.",
        "",
        "Each tree's own worker runtime (`Runner`, detokenizer, stop strings, events, the default flush window) in "
        "one process over a zero-cost engine (benchmarks/worker/runtime_side.py): the engine loop over a batched "
        "engine that advances every live sequence one token per step; the runtime before it over a lockstep engine "
        "whose sequences' `step()` all wait for one shared zero-cost batch step (what both real engines did). "
        f"{report['tokens']} tokens per stream, medians of {report['rounds']} rounds (each a fresh process per "
        "tree, in alternating order). Floor: a bare loop of the per-token work (incremental detokenization, the "
        "stop-string check) over the same rows.",
        "",
        "| streams | new tok/s | old tok/s | new / old | new ms/step | old ms/step | floor ms/step |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, got in report["in_process"].items():
        m = got["medians"]
        lines.append(
            f"| {n} | {m['new']['tokens_per_s']:,.0f} | {m['old']['tokens_per_s']:,.0f} | "
            f"{m['new']['tokens_per_s'] / m['old']['tokens_per_s']:.1f}x | {m['new']['ms_per_step']:.3f} | "
            f"{m['old']['ms_per_step']:.3f} | {m['floor']['ms_per_step']:.3f} |"
        )
    lone = report.get("lone_stream")
    if lone:
        lines += [
            "",
            "## A lone stream: what a step costs beyond the model",
            "",
            "One stream over the same engines with a model call of fixed length per step (a sleep, which releases "
            "the GIL as onnxruntime and torch do): inter-token time minus the model's time, per step.",
            "",
            "| model step | new | old |",
            "|---:|---:|---:|",
            *[
                f"| {ms} ms | +{got['overhead_ms']['new']:.3f} ms | +{got['overhead_ms']['old']:.3f} ms |"
                for ms, got in lone.items()
            ],
        ]
    service = report.get("service")
    if service is not None:
        a, b = service["medians"]["new"], service["medians"]["old"]
        ca, cb = service["cpu_ms_per_1k_tokens"]["new"], service["cpu_ms_per_1k_tokens"]["old"]
        lines += [
            "",
            f"## Through the service: {service['streams']} streams, gateway (router embedded) -> stream transport "
            "-> worker process",
            "",
            "Each tree's worker process over the same zero-cost engine (new: benchmarks/gateway/instant_worker.py, "
            "batched; old: benchmarks/worker/lockstep_worker.py, its sequences waiting for one shared step), its "
            "gateway with the router embedded (benchmarks/gateway/tree_mesh.py), closed loop at "
            f"{service['streams']} streams of {report['tokens']} tokens, interleaved rounds.",
            "",
            "| tree | tok/s | frames/token | e2e p50 ms | CPU ms per 1k tokens: worker / gateway / client |",
            "|---|---:|---:|---:|---:|",
            f"| new | {a['tokens_per_s']:,.0f} | {a['frames_per_token']:.3f} | {a['e2e_ms_p50']:.1f} | "
            f"{ca['worker']:.0f} / {ca['gateway_embedded']:.0f} / {ca['client']:.0f} |",
            f"| old | {b['tokens_per_s']:,.0f} | {b['frames_per_token']:.3f} | {b['e2e_ms_p50']:.1f} | "
            f"{cb['worker']:.0f} / {cb['gateway_embedded']:.0f} / {cb['client']:.0f} |",
        ]
        lines += [f"\n{note}" for note in service["notes"]]
    lines += ["", "## Targets", "", "```", *[target_line(row) for row in report["targets"]], "```"]
    history = report.get("history", [])
    if history:
        lines += [
            "",
            "## Earlier runs",
            "",
            "| date | commit | " + " | ".join(r["name"] for r in report["targets"]) + " |",
        ]
        lines.append("|---|---|" + "---:|" * len(report["targets"]))
        for h in history[-8:]:
            lines.append(
                f"| {h['date']} | {h['commit']} | "
                + " | ".join(str(h["values"].get(r["name"], "")) for r in report["targets"])
                + " |"
            )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshserve bench worker-runtime", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ab-tree", type=Path, required=True, help="the tree before the change (git worktree add)")
    parser.add_argument("--streams", default="1,16,64,256")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1, help="measures per process (median)")
    parser.add_argument("--service", action="store_true", help="also 64 streams through gateway + worker processes")
    parser.add_argument("--service-duration", type=float, default=5.0)
    parser.add_argument("--service-rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = parser.parse_args(argv)
    tree = check_tree(args.ab_tree, "--ab-tree")
    streams = [int(s) for s in args.streams.split(",") if s]
    report: dict[str, Any] = {
        "benchmark": "worker_runtime",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "command": "meshserve bench worker-runtime " + " ".join(argv if argv is not None else sys.argv[1:]),
        "trees": {"new": describe(None), "old": describe(tree)},
        "tokens": args.tokens,
        "rounds": args.rounds,
        "in_process": in_process(tree, streams, args.tokens, args.rounds, args.repeats),
        "lone_stream": lone_stream(tree, args.tokens, args.rounds),
    }
    if args.service:
        report["service"] = asyncio.run(through_service(tree, args.tokens, args.service_duration, args.service_rounds))
    report["machine"]["load_avg_1m"] = os.getloadavg()[0]
    report["targets"] = targets(report)
    previous = args.out / "worker_runtime.json"
    history: list[dict[str, Any]] = []
    if previous.is_file():
        old = json.loads(previous.read_text())
        values = {r["name"]: r["value"] for r in old.get("targets", [])}
        history = [
            *old.get("history", []),
            {"date": old["date"], "commit": old["trees"]["new"]["commit"], "values": values},
        ]
    report["history"] = history[-8:]
    args.out.mkdir(parents=True, exist_ok=True)
    previous.write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "worker_runtime.md").write_text(markdown(report))
    for row in report["targets"]:
        print(target_line(row))
    return 0 if all(row["pass"] for row in report["targets"]) else 1


if __name__ == "__main__":
    sys.exit(main())
