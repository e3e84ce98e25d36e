"""``meshserve bench relay``: tokens relayed per second through gateway + router (target ≥ 5,000 on 2 cores).

Starts, as separate processes: redis-server, one real worker process over the synthetic engine of
:mod:`benchmarks.gateway.instant_worker` (no model time; up to 64 sequences at once), the real router and the
real gateway (API key, rate-limit admission and stream lease in Redis; limits set high enough never to
reject). Then, closed loop, ``--streams`` concurrent greedy streams of ``--max-tokens`` tokens each
(response cache bypassed) for ``--duration`` seconds, (a) straight to the worker and (b) through
gateway → router → worker, alternating ``--rounds`` times. Two worker modes, one stack each:

* **paced** (judged): every stream gets one token per ``--token-interval-ms`` (default 5 ms: 32 streams
  offer 6,400 tok/s), the rhythm of a real engine's decode steps, so tokens reach the hops one at a
  time and are merged into one frame only when a hop falls behind;
* **instant**: tokens at once, so most of a stream's tokens travel in a few frames (coalescing's best case).

Reports tokens/s received by the client, frames per token, end-to-end latency over the pacing floor,
and CPU ms per 1,000 tokens of each process (/proc schedstat), and writes docs/benchmarks/relay.json
and .md. The client, the worker and both hops share the machine's cores. ``--ab-tree TREE`` runs
:mod:`benchmarks.gateway.relay_ab` instead: this tree's meshes and TREE's side by side in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from benchmarks import earlier_runs
from benchmarks.gateway.relay_measure import TARGET_TOKENS_PER_S, measure
from benchmarks.load.senders import grpc_sender, worker_sender
from services.cli.client import MeshClient
from services.common.model_paths import model_paths
from services.common.pb.meshserve.internal.v1 import worker_pb2_grpc
from services.common.processes import ServiceProcess
from services.common.tokenizer import Tokenizer
from services.local.mesh import DEV_API_KEY, api_key_hash
from services.local.redis_server import spawn_redis


async def _start(name: str, argv: list[str], env: dict[str, str], health: bool = True) -> ServiceProcess:
    proc = ServiceProcess(name, argv, env, lambda _n, _l: None)
    await proc.spawn()
    await proc.wait_started(120)
    if health:
        await proc.wait_serving(120)
    return proc


async def start_stack(
    tmp: str, slots: int, token_interval_ms: float = 0.0, *, embedded: bool = False
) -> dict[str, ServiceProcess]:
    """redis, instant worker, router, gateway (in that order; stop in reverse); with ``embedded`` also
    ``gateway_embedded``, a gateway with the router in its process (on the same worker and Redis)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs: dict[str, ServiceProcess] = {}
    try:
        procs["redis"], redis_url = await spawn_redis(tmp, lambda _n, _l: None, env)  # as `meshserve up` runs it
    except RuntimeError as exc:
        raise SystemExit(f"bench relay: {exc}") from None
    worker_env = {
        "MESHSERVE_INSTANT_WORKER_MAX_ACTIVE_SEQUENCES": str(slots),
        "MESHSERVE_INSTANT_WORKER_MAX_QUEUE": str(slots),
        "MESHSERVE_INSTANT_WORKER_WORKER_ID": "instant",
        "MESHSERVE_INSTANT_WORKER_TOKEN_INTERVAL_MS": str(token_interval_ms),
    }
    procs["worker"] = await _start(
        "worker", [sys.executable, "-m", "benchmarks.gateway.instant_worker"], env | worker_env
    )
    router_env = {"MESHSERVE_ROUTER_EDGE_WORKERS": procs["worker"].address, "MESHSERVE_ROUTER_REDIS_URL": redis_url}
    procs["router"] = await _start("router", [sys.executable, "-m", "services.router"], env | router_env)
    gateway_env = {
        "MESHSERVE_GATEWAY_API_KEYS": f"dev:{api_key_hash(DEV_API_KEY)}",
        "MESHSERVE_GATEWAY_REDIS_URL": redis_url,
        "MESHSERVE_GATEWAY_ROUTER_ADDRESS": procs["router"].address,
        "MESHSERVE_GATEWAY_REQUESTS_PER_MINUTE": "100000000",
        "MESHSERVE_GATEWAY_TOKENS_PER_MINUTE": "1000000000",
        "MESHSERVE_GATEWAY_MAX_CONCURRENT_STREAMS": "4096",
    }
    procs["gateway"] = await _start("gateway", [sys.executable, "-m", "services.gateway"], env | gateway_env)
    if embedded:
        embedded_env = gateway_env | router_env | {"MESHSERVE_GATEWAY_EMBED_ROUTER": "1", "MESHSERVE_ROUTER_PORT": "0"}
        argv = [sys.executable, "-m", "services.gateway"]
        procs["gateway_embedded"] = await _start("gateway_embedded", argv, env | embedded_env)
    return procs


async def _run_mode(
    streams: int, max_tokens: int, duration: float, rounds: int, token_interval_ms: float
) -> dict[str, list[dict[str, Any]]]:
    tmp = tempfile.TemporaryDirectory(prefix="meshserve-relay-")
    procs = await start_stack(tmp.name, max(64, streams), token_interval_ms, embedded=True)
    try:
        pids = {n: p.proc.pid for n, p in procs.items() if p.proc is not None} | {"client": os.getpid()}
        tokenizer = Tokenizer(model_paths().hf_dir)
        async with (
            MeshClient(procs["gateway"].address, DEV_API_KEY) as client,
            MeshClient(procs["gateway_embedded"].address, DEV_API_KEY) as embedded_client,
            grpc.aio.insecure_channel(procs["worker"].address) as channel,
        ):
            paths = {
                "direct_worker": worker_sender(worker_pb2_grpc.WorkerStub(channel), tokenizer.encode),
                "gateway_router": grpc_sender(client),
                "gateway_embedded_router": grpc_sender(embedded_client),
            }
            for send in paths.values():  # warm up
                await measure(send, streams, max_tokens, 2.0, pids)
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in paths}
            for i in range(rounds):
                for name, send in paths.items():
                    runs[name].append(await measure(send, streams, max_tokens, duration, pids))
                    print(
                        f"[interval {token_interval_ms:g} ms] round {i + 1}/{rounds} {name}: "
                        f"{runs[name][-1]['tokens_per_s']:.0f} tok/s",
                        file=sys.stderr,
                    )
    finally:
        for name in ("gateway_embedded", "gateway", "router", "worker", "redis"):
            await procs[name].stop()
        tmp.cleanup()
    return runs


async def run(
    streams: int, max_tokens: int, duration: float, rounds: int, token_interval_ms: float = 5.0
) -> dict[str, Any]:
    modes: dict[str, Any] = {}
    for mode, interval in (("paced", token_interval_ms), ("instant", 0.0)):
        runs = await _run_mode(streams, max_tokens, duration, rounds, interval)
        medians = {name: statistics.median(r["tokens_per_s"] for r in rs) for name, rs in runs.items()}
        modes[mode] = {
            "token_interval_ms": interval,
            "offered_tokens_per_s": round(streams * 1000.0 / interval) if interval else None,
            "pacing_floor_ms": round(max_tokens * interval, 1),
            "tokens_per_s_median": medians,
            "runs": runs,
        }
    paced = modes["paced"]
    return {
        "benchmark": "relay",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_1m": os.getloadavg()[0]},
        "command": f"meshserve bench relay --streams {streams} --max-tokens {max_tokens} --duration {duration:g} "
        f"--rounds {rounds} --token-interval-ms {token_interval_ms:g}",
        "streams": streams,
        "max_tokens": max_tokens,
        "target_tokens_per_s": TARGET_TOKENS_PER_S,
        # judged on the paced mode: tokens arrive one per decode step, as from a real engine
        "tokens_per_s_median": paced["tokens_per_s_median"],
        "gateway_router_tokens_per_s": paced["tokens_per_s_median"]["gateway_router"],
        "pass": paced["tokens_per_s_median"]["gateway_router"] >= TARGET_TOKENS_PER_S,
        "runs": paced["runs"],
        "modes": modes,
    }


def derive(report: dict[str, Any]) -> dict[str, Any]:
    """Adds the hops' CPU per 1k relayed tokens (gateway + router, median over rounds) and the tok/s
    those two processes could relay with the machine's cores to themselves: a ceiling that machine
    load does not move (wall tok/s above does)."""
    per_round = [
        r["cpu_ms_per_1k_tokens"]["gateway"] + r["cpu_ms_per_1k_tokens"]["router"]
        for r in report["runs"]["gateway_router"]
    ]
    hop_ms = statistics.median(per_round)
    report["hops_cpu_ms_per_1k_tokens"] = round(hop_ms, 2)
    report["hops_cpu_ms_per_stream"] = round(hop_ms * report["max_tokens"] / 1000, 2)
    fpt = statistics.median(r["frames_per_token"] for r in report["runs"]["gateway_router"])
    report["frames_per_stream"] = round(fpt * report["max_tokens"], 1)
    report["hops_cpu_ceiling_tokens_per_s"] = round((report["machine"]["cpus"] or 1) * 1e6 / hop_ms) if hop_ms else None
    return report


def _mode_table(report: dict[str, Any], mode: dict[str, Any]) -> list[str]:
    lines = [
        "| path | tok/s (median) | frames/token | e2e p50 ms | e2e p99 ms | CPU ms / 1k tokens "
        "(client, gateway, router, gateway_embedded, worker, redis) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, rs in mode["runs"].items():
        last = rs[-1]
        cpu = last["cpu_ms_per_1k_tokens"]
        names = ("client", "gateway", "router", "gateway_embedded", "worker", "redis")
        cpu_text = ", ".join(f"{cpu.get(n, 0):.0f}" for n in names)
        lines.append(
            f"| {name} | {mode['tokens_per_s_median'][name]:,.0f} | {last['frames_per_token']:.2f} | "
            f"{last['e2e_ms_p50']:.1f} | {last['e2e_ms_p99']:.1f} | {cpu_text} |"
        )
    return lines


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Tokens relayed per second through gateway + router",
        "",
        f"{report['date']} · {report['machine']['cpus']} CPUs shared by the client, the worker, both hops and Redis "
        f"(1-min load average {report['machine']['load_avg_1m']:.2f} at the end) · `{report['command']}`",
        "",
        f"{report['streams']} concurrent greedy streams of {report['max_tokens']} tokens from a synthetic worker "
        "(no model time), cache bypassed; medians of the rounds. Target: ≥ "
        f"{report['target_tokens_per_s']:,.0f} tok/s through gateway + router.",
    ]
    modes = report["modes"]
    for name, mode in modes.items():
        if mode["token_interval_ms"]:
            title = (
                f"## Paced (judged): one token per {mode['token_interval_ms']:g} ms per stream, "
                f"{mode['offered_tokens_per_s']:,} tok/s offered"
            )
            note = (
                f"Each stream gets its tokens one decode step apart, as from a real engine, so e2e cannot go below "
                f"{mode['pacing_floor_ms']:g} ms. Frames are merged only when a hop falls behind; the e2e above "
                "that floor is what falling behind cost."
            )
        else:
            title = f"## {name.capitalize()}: tokens at once (coalescing's best case)"
            note = (
                "The synthetic worker produces a stream's tokens faster than a frame is written, so most of them "
                "travel together in a few frames: this measures call set-up and settlement more than frames."
            )
        lines += ["", title, "", *_mode_table(report, mode), "", note]
    verdict = "pass" if report["pass"] else "fail"
    lines += [
        "",
        "`gateway_router`: gateway and router as separate processes (`meshserve up`'s default);"
        " `gateway_embedded_router`: the router inside the gateway's process (`meshserve up --embed-router`).",
        "",
        f"Through gateway + router, paced: **{report['gateway_router_tokens_per_s']:,.0f} tok/s — {verdict}**.",
    ]
    embedded = report["tokens_per_s_median"].get("gateway_embedded_router")
    if embedded is not None:
        ok = "pass" if embedded >= report["target_tokens_per_s"] else "fail"
        lines.append(f"Through the gateway with the router embedded, paced: **{embedded:,.0f} tok/s — {ok}**.")
    if report.get("hops_cpu_ceiling_tokens_per_s"):
        lines.append(
            f"Paced, gateway + router spend {report['hops_cpu_ms_per_1k_tokens']:.0f} CPU ms per 1,000 relayed tokens "
            f"(median of rounds) in ~{report['frames_per_stream']:g} frames per {report['max_tokens']}-token stream: "
            f"with all {report['machine']['cpus']} cores to themselves they could relay at most "
            f"~{report['hops_cpu_ceiling_tokens_per_s']:,.0f} tok/s."
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshserve bench relay", description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32, help="concurrent streams (default 32)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per stream (default 256)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per round and path (default 10)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per path (default 3)")
    parser.add_argument(
        "--token-interval-ms", type=float, default=5.0, help="paced mode: ms between a stream's tokens (default 5)"
    )
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"), help="output directory")
    parser.add_argument(
        "--ab-tree",
        type=Path,
        default=None,
        help="A/B: also run meshes from this source tree (e.g. a `git worktree` of an earlier commit; this tree's "
        "own path for an A/A run), interleaved with this tree's; writes relay_ab.json/.md "
        "(benchmarks/gateway/relay_ab.py)",
    )
    args = parser.parse_args(argv)
    if args.ab_tree is not None:
        from benchmarks.gateway import relay_ab
        from benchmarks.gateway.tree_mesh import check_tree

        tree = check_tree(args.ab_tree, "relay --ab-tree")
        ab = asyncio.run(
            relay_ab.run(tree, args.streams, args.max_tokens, args.duration, args.rounds, args.token_interval_ms)
        )
        relay_ab.write_report(ab, args.out)
        print(relay_ab.markdown(ab))
        return 0
    report = derive(asyncio.run(run(args.streams, args.max_tokens, args.duration, args.rounds, args.token_interval_ms)))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "relay.json").write_text(json.dumps(report, indent=2) + "\n")
    earlier_runs.write(args.out / "relay.md", markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
