"""Router benchmark: decision cost, added latency, and cache-aware vs round-robin routing.

1. Decision cost: block hashing + tier choice + replica choice for one request (µs), cache-aware
   vs round-robin, 8 replicas, 512-token prompts.
2. Added latency: the real router (``start_router``) in front of an in-process worker that streams
   instantly, vs the same worker called directly; TTFT and total time p50/p99 (sequential requests).
3. Multi-turn workload with shared system prompts (:mod:`benchmarks.router.sim`): prefix-cache hit
   rate and TTFT under both policies, on simulated replicas (many replicas and conversations in
   seconds); the routing code is the real one. :mod:`benchmarks.router.prefix` runs the comparison
   on real cloud workers with their prefix KV cache (docs/benchmarks/router_prefix.md).

Run: ``.venv/bin/python -m benchmarks.router.bench`` (about a minute). Writes
docs/benchmarks/router.json and docs/benchmarks/router.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import os
import platform
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from benchmarks.router.sim import SimConfig, simulate
from benchmarks.stats import percentile
from services.common.config import ServiceSettings, load_settings
from services.common.model_paths import model_paths
from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.serving import MAX_MESSAGE_BYTES, start_server
from services.common.tokenizer import Tokenizer
from services.router.balancer.blocks import block_hashes
from services.router.balancer.policies.base import Candidate
from services.router.balancer.policies.cache_aware import CacheAware
from services.router.balancer.policies.round_robin import RoundRobin
from services.router.balancer.tiers import TierName, choose_tier
from services.router.config import RouterSettings
from services.router.server import start_router
from services.worker.mux import MuxCalls
from services.worker.mux_tcp import StreamMuxServer

TOKEN = "bench-token"
OUT = Path("docs/benchmarks")


def decision_cost(n: int = 20000, rounds: int = 20) -> dict[str, float]:
    """µs per decision: medians over ``rounds`` interleaved rounds, wall time and the thread's CPU
    time (robust to other load on a shared machine), plus the SHA-256 block hashing alone."""
    rng = random.Random(1)
    systems = [[rng.randrange(3, 40000) for _ in range(400)] for _ in range(8)]
    prompts = [rng.choice(systems) + [rng.randrange(3, 40000) for _ in range(112)] for _ in range(256)]
    names = [f"10.0.0.{i}:7101" for i in range(8)]
    loads = [rng.randrange(0, 6) for _ in names]
    selector = CacheAware()
    rr = RoundRobin()
    healthy = {TierName.EDGE, TierName.CLOUD}

    def cache_aware(prompt: list[int]) -> None:
        choose_tier(len(prompt), None, healthy, 128)
        selector.select([Candidate(a, b) for a, b in zip(names, loads, strict=True)], block_hashes(prompt, 16))

    def round_robin(prompt: list[int]) -> None:
        choose_tier(len(prompt), None, healthy, 128)
        rr.select([Candidate(a, b) for a, b in zip(names, loads, strict=True)], (), group="cloud")

    def hashing(prompt: list[int]) -> None:
        block_hashes(prompt, 16)

    fns = {"cache_aware": cache_aware, "round_robin": round_robin, "hashing": hashing}
    wall: dict[str, list[float]] = {label: [] for label in fns}
    cpu: dict[str, list[float]] = {label: [] for label in fns}
    for fn in fns.values():
        for p in prompts[:64]:
            fn(p)
    per = max(1, n // rounds)
    for r in range(rounds):
        for label, fn in fns.items():  # interleaved: a change of machine load hits every variant
            t0, c0 = time.perf_counter(), time.thread_time()
            for i in range(per):
                fn(prompts[(r * per + i) % len(prompts)])
            cpu[label].append((time.thread_time() - c0) / per * 1e6)
            wall[label].append((time.perf_counter() - t0) / per * 1e6)
    out = {"load_average_1m": os.getloadavg()[0]}
    for label in fns:
        out[f"{label}_us_per_request"] = percentile(wall[label], 50)
        out[f"{label}_cpu_us_per_request"] = percentile(cpu[label], 50)
    return out


class _InstantWorker(worker_pb2_grpc.WorkerServicer):
    """Streams ``max_tokens`` tokens as fast as it can (isolates the router's own cost): over gRPC
    for the direct baseline, over its stream transport for the router, as a real worker."""

    stream_port = 0

    async def Generate(
        self,
        request_iterator: AsyncIterator[worker_pb2.WorkerRequest],
        context: grpc.aio.ServicerContext | None = None,
    ) -> AsyncIterator[worker_pb2.WorkerResponse]:
        async for req in request_iterator:
            if not req.HasField("start"):
                continue
            n = req.start.sampling.max_tokens
            for i in range(n):
                yield worker_pb2.WorkerResponse(sequence=i, token_ids=[100 + i], text=" x")
            yield worker_pb2.WorkerResponse(
                sequence=n, final=worker_pb2.WorkerFinal(finish_reason=pb.FINISH_REASON_LENGTH, completion_tokens=n)
            )

    async def Stats(
        self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStats:
        return worker_pb2.WorkerStats(
            worker_id="instant", tier=pb.TIER_EDGE, max_active_sequences=64, stream_port=self.stream_port
        )


async def _timed(stream: AsyncIterator[object]) -> tuple[float, float]:
    t0 = time.perf_counter()
    first = float("nan")
    async for _ in stream:
        if first != first:
            first = time.perf_counter() - t0
    return first, time.perf_counter() - t0


async def added_latency(n: int) -> dict[str, float]:
    service = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
    instant = _InstantWorker()  # type: ignore[abstract]  # a Generate-only stand-in
    stream = StreamMuxServer(instant.Generate, MuxCalls(), TOKEN, MAX_MESSAGE_BYTES)
    await stream.start("127.0.0.1", 0)
    instant.stream_port = stream.port
    worker = await start_server(
        ServiceSettings(port=0, internal_token=TOKEN, shutdown_grace_s=0),
        lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(instant, s),
        [service],
        internal=True,
    )
    worker.on_stop.append(stream.finish)
    settings = load_settings(
        RouterSettings, edge_workers=f"127.0.0.1:{worker.port}", internal_token=TOKEN, shutdown_grace_s=0
    )
    router, _ = await start_router(settings, tokenizer=Tokenizer(model_paths().hf_dir))
    meta = (("x-meshserve-internal-token", TOKEN), ("x-meshserve-tenant", "bench"))
    samples: dict[str, list[tuple[float, float]]] = {"direct": [], "router": []}
    prompt = "Write a short poem about the sea."
    ids = Tokenizer(model_paths().hf_dir).encode(prompt)
    try:
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as wch,
            grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as rch,
        ):
            wstub = worker_pb2_grpc.WorkerStub(wch)
            rstub = inference_pb2_grpc.InferenceStub(rch)
            sampling = pb.SamplingParams(max_tokens=16, temperature=0.0)
            request = pb.GenerateRequest(
                prompt=prompt, sampling=sampling, routing=pb.RoutingOptions(cache_policy=pb.CACHE_POLICY_BYPASS)
            )

            async def direct() -> AsyncIterator[object]:
                call = wstub.Generate(metadata=meta)
                await call.write(
                    worker_pb2.WorkerRequest(start=worker_pb2.WorkerStart(prompt_token_ids=ids, sampling=sampling))
                )
                async for frame in call:
                    yield frame
                    if frame.HasField("final"):
                        call.cancel()
                        return

            for i in range(n + 20):
                plain = await _timed(direct())
                routed = await _timed(rstub.Generate(request, metadata=meta))
                if i >= 20:  # warm-up
                    samples["direct"].append(plain)
                    samples["router"].append(routed)
    finally:
        await router.stop()
        await worker.stop()
    out: dict[str, float] = {"requests": n}
    for label, idx in (("ttft", 0), ("total", 1)):
        d = [s[idx] * 1000 for s in samples["direct"]]
        r = [s[idx] * 1000 for s in samples["router"]]
        for q in (50, 99):
            out[f"direct_{label}_ms_p{q}"] = percentile(d, q)
            out[f"router_{label}_ms_p{q}"] = percentile(r, q)
            out[f"added_{label}_ms_p{q}"] = percentile(r, q) - percentile(d, q)
    return out


SCENARIOS = {
    "generous_cache": SimConfig(),
    "cache_pressure": SimConfig(cache_blocks=384, system_prompts=12),
    "8_replicas_16_system_prompts": SimConfig(replicas=8, cache_blocks=256, system_prompts=16, arrival_rate=10.0),
}


def workload() -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for name, cfg in SCENARIOS.items():
        rr = simulate("round_robin", cfg)
        ca = simulate("cache_aware", cfg)
        out[name] = {
            "config": dataclasses.asdict(cfg),
            "round_robin": rr,
            "cache_aware": ca,
            "ttft_mean_change_pct": 100 * (ca["ttft_ms_mean"] / rr["ttft_ms_mean"] - 1),
            "ttft_p50_change_pct": 100 * (ca["ttft_ms_p50"] / rr["ttft_ms_p50"] - 1),
        }
    return out


def _markdown(report: dict[str, object]) -> str:
    dc = report["decision_cost"]
    al = report["added_latency"]
    assert isinstance(dc, dict) and isinstance(al, dict)
    lines = [
        "# Router benchmark",
        "",
        f"{report['date']} · {report['machine']} · `.venv/bin/python -m benchmarks.router.bench`",
        "",
        "## Decision cost (tier + replica choice, 512-token prompt, 8 replicas)",
        "",
        "Medians of interleaved rounds; CPU = the benchmark thread's CPU time, robust to other load",
        f"(load average {dc['load_average_1m']:.1f} when measured).",
        "",
        "| policy | µs / request (wall) | µs / request (CPU) |",
        "|---|---|---|",
        f"| cache-aware (SHA-256 block hashes + bounded-load CH + prefix + P2C) | "
        f"{dc['cache_aware_us_per_request']:.1f} | {dc['cache_aware_cpu_us_per_request']:.1f} |",
        f"| of which block hashing (32 blocks of 16 tokens) | {dc['hashing_us_per_request']:.1f} | "
        f"{dc['hashing_cpu_us_per_request']:.1f} |",
        f"| round-robin | {dc['round_robin_us_per_request']:.1f} | {dc['round_robin_cpu_us_per_request']:.1f} |",
        "",
        f"## Added latency (router in front of an instant worker, {al['requests']} sequential requests, 16 tokens)",
        "",
        "| | direct p50 | router p50 | added p50 | direct p99 | router p99 | added p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    for label in ("ttft", "total"):
        lines.append(
            f"| {label} (ms) | {al[f'direct_{label}_ms_p50']:.2f} | {al[f'router_{label}_ms_p50']:.2f} | "
            f"{al[f'added_{label}_ms_p50']:.2f} | {al[f'direct_{label}_ms_p99']:.2f} | "
            f"{al[f'router_{label}_ms_p99']:.2f} | {al[f'added_{label}_ms_p99']:.2f} |"
        )
    lines += [
        "",
        "## Multi-turn workload with shared system prompts: cache-aware vs round-robin",
        "",
        "Simulated replicas with LRU prefix KV caches (see benchmarks/router/sim.py for the model and",
        "its parameters); the replica choice is the router's real policy code. Anchor: Ray Serve reports",
        "-60 % TTFT from prefix-aware routing. With real workers: [router_prefix.md](router_prefix.md).",
        "",
        "| scenario | policy | prefix hit rate | TTFT mean (ms) | p50 | p99 | TTFT mean change |",
        "|---|---|---|---|---|---|---|",
    ]
    wl = report["workload"]
    assert isinstance(wl, dict)
    for name, res in wl.items():
        for pol in ("round_robin", "cache_aware"):
            r = res[pol]
            change = f"{res['ttft_mean_change_pct']:+.0f} %" if pol == "cache_aware" else ""
            lines.append(
                f"| {name} | {pol} | {r['prefix_hit_rate']:.1%} | {r['ttft_ms_mean']:.0f} | "
                f"{r['ttft_ms_p50']:.0f} | {r['ttft_ms_p99']:.0f} | {change} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="sequential requests for the added-latency part")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    report: dict[str, object] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared)",
        "decision_cost": decision_cost(),
        "added_latency": asyncio.run(added_latency(args.requests)),
        "workload": workload(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "router.json").write_text(json.dumps(report, indent=2) + "\n")
    md = _markdown(report)
    (args.out / "router.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
