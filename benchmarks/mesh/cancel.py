"""``meshserve bench cancel``: how many decode steps a worker runs after the client cancels (target ≤ 1).

Starts the local mesh with one worker per tier (launcher of ``meshserve up``), then per tier and per
path — through gateway → router → worker (``Generate``, the call cancelled) and straight to the
worker (internal ``Generate``, a ``WorkerCancel`` message) — runs ``--trials`` greedy requests of
256 tokens with the response cache bypassed, each cancelled after 2 to 8 received tokens. The
worker's own counter (``Stats.tokens_generated_total``, read before the request and after the
worker reports no active sequence) gives the tokens it generated; minus the tokens the client had
received when it cancelled = **decode steps after cancel**, which includes tokens already in flight
to the client. Also reported: ms from cancel to the worker's sequence ending (polled every 5 ms).
Only one request is on the mesh at a time. Writes docs/benchmarks/cancel.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from benchmarks.stats import percentile
from services.cli.client import MeshClient, routing_options, sampling_params
from services.common.config import DEFAULT_INTERNAL_TOKEN
from services.common.model_paths import model_paths
from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.tokenizer import Tokenizer
from services.local.mesh import DEV_API_KEY, Mesh, MeshConfig

INTERNAL = (("x-meshserve-internal-token", DEFAULT_INTERNAL_TOKEN),)
PROMPTS = {"edge": "Tell me a long story about a dragon and a knight.", "cloud": "Write a long essay about rivers."}


class _Direct:
    """An internal Generate call whose start message is written on the first read."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.started = False

    def cancel(self) -> None:
        self.call.cancel()


async def _idle(worker: worker_pb2_grpc.WorkerStub, timeout_s: float = 10.0) -> worker_pb2.WorkerStats:
    """Stats once the worker runs no sequence (bounded)."""
    deadline = time.perf_counter() + timeout_s
    while True:
        stats = await worker.Stats(worker_pb2.StatsRequest(), metadata=INTERNAL)
        if (stats.active_sequences == 0 and stats.queue_depth == 0) or time.perf_counter() > deadline:
            return stats
        await asyncio.sleep(0.005)


async def _trial(
    worker: worker_pb2_grpc.WorkerStub, open_call: Callable[[], Any], read: Callable[[Any], Any], cancel: Any, k: int
) -> tuple[int, float]:
    before = (await _idle(worker)).tokens_generated_total
    call = open_call()
    received = 0
    try:
        while received < k:
            frame = await read(call)
            if frame is grpc.aio.EOF or frame.HasField("final"):
                break
            received += len(frame.token_ids)
        t_cancel = time.perf_counter()
        await cancel(call)
        after = await _idle(worker)
        ended_ms = (time.perf_counter() - t_cancel) * 1000
    finally:
        call.cancel()
    return after.tokens_generated_total - before - received, ended_ms


async def _tier(
    client: MeshClient, worker: worker_pb2_grpc.WorkerStub, ids: list[int], tier: str, trials: int, rng: random.Random
) -> dict[str, Any]:
    sampling = sampling_params(max_tokens=256, temperature=0.0)
    request = pb.GenerateRequest(
        prompt=PROMPTS[tier], sampling=sampling, routing=routing_options(tier, pb.CACHE_POLICY_BYPASS)
    )
    start = worker_pb2.WorkerRequest(
        start=worker_pb2.WorkerStart(request_id="cancel-bench", prompt_token_ids=ids, sampling=sampling)
    )

    def mesh_call() -> Any:
        return client.generate_call(request)

    async def mesh_read(call: Any) -> Any:
        return await call.read()

    async def mesh_cancel(call: Any) -> None:
        call.cancel()

    def direct_call() -> Any:
        return _Direct(worker.Generate(metadata=INTERNAL))

    async def direct_read(direct: _Direct) -> Any:
        if not direct.started:
            direct.started = True
            await direct.call.write(start)
        return await direct.call.read()

    async def direct_cancel(direct: _Direct) -> None:
        await direct.call.write(worker_pb2.WorkerRequest(cancel=worker_pb2.WorkerCancel()))

    paths = {
        "gateway_router": (mesh_call, mesh_read, mesh_cancel),
        "direct_worker": (direct_call, direct_read, direct_cancel),
    }
    for path in paths.values():  # warm-up
        await _trial(worker, *path, 2)
    rows: dict[str, list[tuple[int, float]]] = {name: [] for name in paths}
    for i in range(trials):
        k = rng.randint(2, 8)
        for name, path in paths.items():
            rows[name].append(await _trial(worker, *path, k))
        print(f"\rcancel: {tier} trial {i + 1}/{trials}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return {name: _summary(r) for name, r in rows.items()}


async def run(trials: int, tiers: Sequence[str]) -> dict[str, Any]:
    config = MeshConfig(edge_workers=1 if "edge" in tiers else 0, cloud_workers=1 if "cloud" in tiers else 0)
    config.extra_env["MESHSERVE_GATEWAY_REQUESTS_PER_MINUTE"] = "100000000"
    tokenizer = Tokenizer(model_paths().hf_dir)
    rng = random.Random(5)
    results: dict[str, Any] = {}
    async with Mesh(config, sink=lambda _n, _l: None) as mesh, MeshClient(mesh.gateway_address, DEV_API_KEY) as client:
        for tier in tiers:
            async with grpc.aio.insecure_channel(mesh.workers(tier)[0].address) as channel:
                worker = worker_pb2_grpc.WorkerStub(channel)
                results[tier] = await _tier(client, worker, tokenizer.encode(PROMPTS[tier]), tier, trials, rng)
    worst = max(v["steps_after_cancel_p99"] for t in results.values() for v in t.values())
    return {
        "benchmark": "cancel",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_1m": os.getloadavg()[0]},
        "command": f"meshserve bench cancel --trials {trials} --tiers {','.join(tiers)}",
        "trials": trials,
        "results": results,
        "steps_after_cancel_p99": worst,
    }


def _summary(rows: list[tuple[int, float]]) -> dict[str, float]:
    steps = [float(s) for s, _ in rows]
    ms = [m for _, m in rows]
    return {
        "trials": len(rows),
        "steps_after_cancel_p50": percentile(steps, 50),
        "steps_after_cancel_p99": percentile(steps, 99),
        "steps_after_cancel_max": max(steps),
        "cancel_to_ended_ms_p50": round(percentile(ms, 50), 2),
        "cancel_to_ended_ms_p99": round(percentile(ms, 99), 2),
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Cancel latency in decode steps",
        "",
        f"{report['date']} · {report['machine']['cpus']} CPUs shared with other work (1-min load average "
        f"{report['machine']['load_avg_1m']:.2f} at the end) · `{report['command']}`",
        "",
        "Steps after cancel = tokens the worker generated (its own counter) minus tokens the client had "
        "received when it cancelled; includes tokens in flight. Target: within one decode step.",
        "",
        "| tier | path | trials | steps p50 | steps p99 | steps max | cancel → sequence ended ms p50 | p99 |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for tier, paths in report["results"].items():
        for name, s in paths.items():
            lines.append(
                f"| {tier} | {name} | {s['trials']} | {s['steps_after_cancel_p50']:.1f} | "
                f"{s['steps_after_cancel_p99']:.1f} | {s['steps_after_cancel_max']:.0f} | "
                f"{s['cancel_to_ended_ms_p50']:.1f} | {s['cancel_to_ended_ms_p99']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshserve bench cancel", description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20, help="cancelled requests per tier and path (default 20)")
    parser.add_argument("--tiers", default="edge,cloud", help="tiers to measure (default edge,cloud)")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"), help="output directory")
    args = parser.parse_args(argv)
    tiers = [t for t in args.tiers.split(",") if t]
    if not tiers or set(tiers) - {"edge", "cloud"}:
        parser.error("--tiers takes edge, cloud or edge,cloud")
    report = asyncio.run(run(args.trials, tiers))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cancel.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "cancel.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
