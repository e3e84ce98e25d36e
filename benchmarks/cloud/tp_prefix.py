"""Prefix KV through Redis under tensor parallelism: TTFT of a ~1k-token prompt on a TP=3 worker and a TP=1 engine.

``meshserve bench tp-prefix`` (or ``python -m benchmarks.cloud.tp_prefix``). One real redis-server,
one cloud worker as deployed with TP=3 (torchrun, 3 gloo ranks on 127.0.0.1, one thread each, gRPC
on rank 0) and one TP=1 ``CloudEngine`` in this process (one thread), same model version, so both
hash prefixes alike. Each round takes two fresh documents (nothing cached anywhere) and measures the
time to the first token (max_tokens=1) of:

* TP=3: cold; the same document with another question (local prefix blocks); a document the TP=1
  engine computed (imported from Redis: rank 0 loads, one gloo scatter gives each rank its heads);
* TP=1: cold; a document the TP=3 worker computed (its blocks gathered from the ranks on export).

The worker's TTFT includes its gRPC hop on 127.0.0.1. Writes docs/benchmarks/cloud_tp_prefix.json/.md.
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
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import redis.asyncio as aioredis

from benchmarks.cache.bench import start_redis
from benchmarks.cloud.engine import DOC, QUESTIONS, ttft
from services.common.config import DEFAULT_INTERNAL_TOKEN
from services.common.model_paths import model_paths
from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.processes import ServiceProcess
from services.gpu_worker.engine import CloudEngine
from services.gpu_worker.prefix import RedisPrefixCache, chain_keys
from services.store.kv_blocks import KVContext

MODEL_ID = "smollm2-135m-instruct"
VERSION = "bench-tp-prefix"
BT = 16
META = (("x-meshserve-internal-token", DEFAULT_INTERNAL_TOKEN),)


async def _worker_ttft(stub: worker_pb2_grpc.WorkerStub, ids: list[int]) -> tuple[float, int]:
    start = worker_pb2.WorkerRequest(
        start=worker_pb2.WorkerStart(
            request_id="bench", prompt_token_ids=ids, sampling=pb.SamplingParams(max_tokens=1, temperature=0.0)
        )
    )

    async def requests() -> AsyncIterator[worker_pb2.WorkerRequest]:
        yield start

    began, first, prefilled = time.perf_counter(), float("nan"), -1
    async for frame in stub.Generate(requests(), metadata=META):
        if frame.token_ids and first != first:
            first = time.perf_counter() - began
        if frame.HasField("final"):
            prefilled = frame.final.prefill_tokens
            break
    return first, prefilled


async def _wait_exported(url: str, ids: list[int]) -> None:
    """Bounded wait until the worker's background export of ``ids``' reusable blocks is in Redis."""
    last = chain_keys(KVContext(MODEL_ID, VERSION, "", False), BT, ids)[(len(ids) - 1) // BT - 1]
    client = aioredis.Redis.from_url(url)
    try:
        deadline = time.monotonic() + 60
        while not await client.exists(last):
            if time.monotonic() > deadline:
                raise RuntimeError("the TP=3 worker did not export its prefix within 60 s")
            await asyncio.sleep(0.02)
    finally:
        await client.aclose()


async def _start_worker(url: str, world: int, log: list[str]) -> ServiceProcess:
    env = dict(
        os.environ,
        MESHSERVE_GPU_WORKER_HOST="127.0.0.1",
        MESHSERVE_GPU_WORKER_PORT="0",
        MESHSERVE_GPU_WORKER_THREADS="1",
        MESHSERVE_GPU_WORKER_DEVICE="cpu",
        MESHSERVE_GPU_WORKER_WORKER_ID=f"bench-tp{world}",
        MESHSERVE_GPU_WORKER_REDIS_URL=url,
        MESHSERVE_GPU_WORKER_MODEL_ID=MODEL_ID,
        MESHSERVE_GPU_WORKER_MODEL_VERSION=VERSION,
        MESHSERVE_GPU_WORKER_LOG_JSON="true",
        GLOO_SOCKET_IFNAME="lo",
    )
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc-per-node={world}"]
    proc = ServiceProcess(f"bench-tp{world}", [*argv, "-m", "services.gpu_worker"], env, lambda _n, s: log.append(s))
    await proc.spawn()
    await proc.wait_started(300)
    return proc


def _engine(url: str) -> CloudEngine:
    redis = RedisPrefixCache(
        url, block_tokens=BT, budget_bytes=1 << 30, ttl_s=600, timeout_s=2.0, max_block_bytes=64 << 20
    )
    return CloudEngine(
        str(model_paths().hf_dir),
        model_id=MODEL_ID,
        model_version=VERSION,
        device="cpu",
        threads=1,
        kv_budget_bytes=256 << 20,
        redis=redis,
    )


async def measure(url: str, world: int, rounds: int) -> dict[str, Any]:
    log: list[str] = []
    engine = await asyncio.to_thread(_engine, url)
    proc = await _start_worker(url, world, log)
    rows: dict[str, list[tuple[float, int]]] = {
        f"tp{world}_cold": [],
        f"tp{world}_local_prefix": [],
        f"tp{world}_redis_prefix_from_tp1": [],
        "tp1_cold": [],
        f"tp1_redis_prefix_from_tp{world}": [],
    }

    def encode(doc: str, q: str) -> list[int]:
        return list(engine.tokenizer.encode(f"<|im_start|>user\n{doc}\n{q}<|im_end|>\n<|im_start|>assistant\n").ids)

    try:
        async with grpc.aio.insecure_channel(proc.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            await _worker_ttft(stub, encode("warm-up", QUESTIONS[0]))
            for r in range(rounds):
                print(f"\rtp-prefix: round {r + 1}/{rounds}   ", end="", file=sys.stderr)
                doc_a = f"Document {time.time_ns()}.\n" + DOC * 17  # fresh: nothing cached anywhere
                a = [encode(doc_a, q) for q in QUESTIONS]
                rows[f"tp{world}_cold"].append(await _worker_ttft(stub, a[0]))
                rows[f"tp{world}_local_prefix"].append(await _worker_ttft(stub, a[1]))
                await _wait_exported(url, a[0])
                rows[f"tp1_redis_prefix_from_tp{world}"].append(await asyncio.to_thread(ttft, engine, a[2]))
                doc_b = f"Document {time.time_ns()}.\n" + DOC * 17
                b = [encode(doc_b, q) for q in QUESTIONS]
                rows["tp1_cold"].append(await asyncio.to_thread(ttft, engine, b[0]))
                assert engine.redis is not None
                await asyncio.to_thread(engine.redis.flush)
                rows[f"tp{world}_redis_prefix_from_tp1"].append(await _worker_ttft(stub, b[1]))
            print(file=sys.stderr)
    finally:
        await proc.stop(60)
        await asyncio.to_thread(engine.close)
    out: dict[str, Any] = {"prompt_tokens": len(a[0])}
    for name, v in rows.items():
        out[name] = {"ttft_ms_p50": 1000 * statistics.median(x[0] for x in v), "prefilled_tokens": v[-1][1]}
    for name, cold in ((f"tp{world}", f"tp{world}_cold"), ("tp1", "tp1_cold")):
        for case in rows:
            if case.startswith(name + "_") and case != cold:
                out[case]["speedup_vs_cold"] = out[cold]["ttft_ms_p50"] / out[case]["ttft_ms_p50"]
    return out


def markdown(report: dict[str, Any]) -> str:
    t, m = report["ttft"], report["machine"]
    lines = [
        "# Prefix KV through Redis under tensor parallelism",
        "",
        f"`{report['command']}` — {report['date']}, {m['cpus']} CPUs, load avg {m['load_avg_1m_before']} before /"
        f" {m['load_avg_1m_after']} after, torch {m['torch']}. CPU, gloo, one thread per rank.",
        "",
        f"TTFT (median of {report['rounds']} rounds) of a {t['prompt_tokens']}-token prompt (document + question):",
        "",
        "| case | TTFT p50 (ms) | prompt tokens prefilled | speed-up vs its cold |",
        "|---|---:|---:|---:|",
    ]
    for name, row in t.items():
        if isinstance(row, dict):
            speed = f"{row['speedup_vs_cold']:.1f}x" if "speedup_vs_cold" in row else "—"
            lines.append(f"| {name} | {row['ttft_ms_p50']:.1f} | {row['prefilled_tokens']} | {speed} |")
    lines += [
        "",
        "- The TP worker's TTFT includes its gRPC hop; the TP=1 engine is called in-process.",
        "- 2-core machine shared with other work: wall times are noisy; the prefilled-token counts are exact.",
        "",
    ]
    return "\n".join(lines)


def _load() -> float:
    return os.getloadavg()[0]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshserve bench tp-prefix", description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=3, help="TP degree of the worker (default 3)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, a fresh document pair each (default 3)")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"), help="output directory")
    args = parser.parse_args(argv)
    load_before = _load()
    with tempfile.TemporaryDirectory() as tmp:
        redis_proc, url = start_redis(tmp)
        try:
            result = asyncio.run(measure(url, args.world, args.rounds))
        finally:
            redis_proc.terminate()
            redis_proc.wait()
    import torch

    report = {
        "benchmark": "cloud_tp_prefix",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "load_avg_1m_before": round(load_before, 2),
            "load_avg_1m_after": round(_load(), 2),
        },
        "command": f"meshserve bench tp-prefix --world {args.world} --rounds {args.rounds}",
        "device": "cpu",
        "rounds": args.rounds,
        "ttft": result,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cloud_tp_prefix.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "cloud_tp_prefix.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
