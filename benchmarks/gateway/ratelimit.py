"""Gateway rate limiter on a real redis-server: admission latency and exactness at scale.

``python -m benchmarks.gateway.ratelimit [--requests 2000] [--limiters 4] [--concurrency 64]``

1. Latency: one admit + settle pair at a time (the cost a request pays), p50/p99 in ms.
2. Throughput: ``--concurrency`` admit+settle pairs in flight from ``--limiters`` limiter
   instances (each its own connection pool, like separate gateway replicas).
3. Exactness: a tenant with a burst of N = requests/3 and a 1/min refill; ``requests`` concurrent
   admissions spread over the limiters must admit exactly N.

Writes docs/benchmarks/ratelimit.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis.asyncio as aioredis

from benchmarks.stats import percentile
from services.common.errors import ResourceExhausted
from services.common.logging import configure_logging
from services.gateway.policy import TenantPolicy
from services.gateway.ratelimit import RateLimiter

UNLIMITED = TenantPolicy(requests_per_minute=10**9, tokens_per_minute=10**9, max_concurrent_streams=10**6)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _wait(url: str) -> None:
    client = aioredis.Redis.from_url(url, socket_connect_timeout=0.2)
    try:
        for _ in range(250):  # a just-spawned redis-server has no health API: poll it, bounded
            try:
                if await client.ping():
                    return
            except (OSError, aioredis.ConnectionError):
                await asyncio.sleep(0.02)
        raise RuntimeError("redis-server did not start")
    finally:
        await client.aclose()


def _limiter(url: str) -> RateLimiter:
    return RateLimiter(aioredis.Redis.from_url(url, socket_timeout=2.0, max_connections=256))


async def _pair(limiter: RateLimiter, tenant: str) -> float:
    start = time.perf_counter()
    reservation = await limiter.admit(tenant, UNLIMITED, tokens=200, stream_ttl_s=60)
    await limiter.settle(reservation, 50)
    return time.perf_counter() - start


async def run(url: str, requests: int, limiters_n: int, concurrency: int) -> dict[str, object]:
    limiters = [_limiter(url) for _ in range(limiters_n)]
    try:
        for _ in range(50):  # warm-up: load the scripts, open connections
            await _pair(limiters[0], "warm")
        sequential = [await _pair(limiters[i % limiters_n], "seq") for i in range(requests)]

        semaphore = asyncio.Semaphore(concurrency)

        async def bounded(i: int) -> float:
            async with semaphore:
                return await _pair(limiters[i % limiters_n], f"t{i % 8}")

        start = time.perf_counter()
        concurrent = await asyncio.gather(*(bounded(i) for i in range(requests)))
        elapsed = time.perf_counter() - start

        limit = max(1, requests // 3)
        policy = TenantPolicy(requests_per_minute=1, request_burst=limit, tokens_per_minute=0)

        async def one(i: int) -> bool:
            async with semaphore:
                try:
                    await limiters[i % limiters_n].admit("exact", policy, tokens=0)
                except ResourceExhausted:
                    return False
                return True

        admitted = sum(await asyncio.gather(*(one(i) for i in range(requests))))
    finally:
        for limiter in limiters:
            await limiter.close()
    ms = [s * 1000 for s in sequential]
    cms = [s * 1000 for s in concurrent]
    return {
        "requests": requests,
        "limiters": limiters_n,
        "concurrency": concurrency,
        "sequential_admit_settle_ms": {"p50": percentile(ms, 50), "p99": percentile(ms, 99)},
        "concurrent_admit_settle_ms": {"p50": percentile(cms, 50), "p99": percentile(cms, 99)},
        "concurrent_pairs_per_s": requests / elapsed,
        "exactness": {"limit": limit, "attempted": requests, "admitted": admitted},
    }


def _markdown(report: dict[str, object]) -> str:
    seq = report["sequential_admit_settle_ms"]
    con = report["concurrent_admit_settle_ms"]
    exact = report["exactness"]
    assert isinstance(seq, dict) and isinstance(con, dict) and isinstance(exact, dict)
    return (
        "# Gateway rate limiter (real redis-server, loopback, shared 2-core machine)\n\n"
        "`python -m benchmarks.gateway.ratelimit` — one admit (Lua: requests + token reservation + stream lease)\n"
        "plus one settle (refund + lease release) per request.\n\n"
        "| measure | value |\n|---|---|\n"
        f"| admit+settle, one at a time, p50 / p99 | {seq['p50']:.2f} / {seq['p99']:.2f} ms |\n"
        f"| admit+settle, {report['concurrency']} in flight over {report['limiters']} limiters, p50 / p99 "
        f"| {con['p50']:.2f} / {con['p99']:.2f} ms |\n"
        f"| throughput | {report['concurrent_pairs_per_s']:.0f} admit+settle pairs/s |\n"
        f"| exactness | {exact['admitted']} admitted of {exact['attempted']} for a limit of {exact['limit']} |\n"
        "\nThe concurrent latency is queueing in this one Python client process (in flight / throughput),\n"
        "not Redis: each gateway replica adds its own client-side capacity.\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gateway.ratelimit", description=__doc__)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--limiters", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = parser.parse_args(argv)
    configure_logging("bench", "WARNING", False)  # 1000s of rate_limited lines would drown the numbers
    exe = shutil.which("redis-server")
    if exe is None:
        print("redis-server is not installed; run `make setup`", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        port = _free_port()
        cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", tmp]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        try:
            url = f"redis://127.0.0.1:{port}/0"

            async def go() -> dict[str, object]:
                await _wait(url)
                return await run(url, args.requests, args.limiters, args.concurrency)

            report = asyncio.run(go())
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    print(json.dumps(report, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ratelimit.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "ratelimit.md").write_text(_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
