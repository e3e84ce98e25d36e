"""Cache benchmark: services/cache against raw redis-py on the same transfers, and exact-hit TTFT.

1. Library vs raw redis-py, one local redis-server (started here), interleaved A/B (noise hits both):
   * response entries: our ``ResponseCache.get`` (GET + decode + breaker + counters) vs raw ``GET``;
     our ``put`` vs raw ``SET EX``; with a byte budget, both SET + the ledger script in one pipeline;
   * KV blocks (SmolLM2-135M geometry, fp16 [30, 2, 3, 16, 64] = 360 KiB per block, chains of 32):
     our ``KVBlockStore.put`` / ``load`` / ``match`` (encode/decode + ledger + MGET) vs raw pipelined
     SETs / MGET + ``np.frombuffer`` / EXISTS on SHA-256 chain keys of its own. Latency and MB/s.
2. Exact-hit TTFT through the whole mesh (``services.local.mesh.Mesh``, gRPC): one greedy request
   fills the cache, then repeats are timed through the gateway and straight to the router.

Usage: python -m benchmarks.cache.bench [--requests N] [--skip-mesh] [--out docs/benchmarks]
Writes cache.json and cache.md to the output directory and prints the tables.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import hashlib
import json
import os
import platform
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import redis
import redis.asyncio as aioredis

from benchmarks.cache.ab import ab_latency, ab_throughput
from benchmarks.cache.report import BLOCK_SHAPE, markdown
from benchmarks.stats import percentile
from services.common.sampling import SamplingParams
from services.store.connection import redis_from_url
from services.store.guard import Guard
from services.store.keys import response_key
from services.store.kv_blocks import KVBlockStore, KVContext
from services.store.ledger import account_script
from services.store.response_cache import CachedResponse, Finish, ResponseCache

CHAIN = 32


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(tmp: str) -> tuple[subprocess.Popen[bytes], str]:
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("redis-server is not installed; run `make setup`")
    port = _free_port()
    argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", tmp]
    argv += ["--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_connect_timeout=0.2)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)  # a just-spawned process without a health API
    client.close()
    return proc, f"redis://127.0.0.1:{port}/0"


async def bench_responses(url: str, n: int) -> dict[str, object]:
    cache = ResponseCache.from_url(url, timeout_s=1.0, ttl_s=600, service="bench")
    # Raw redis-py with the same guarantee as ours: every call bounded by a 1 s read timeout.
    raw = aioredis.Redis.from_url(url, socket_timeout=1.0)
    bare = aioredis.Redis.from_url(url)
    resp = CachedResponse(tuple(range(1000, 1128)), "word " * 128, Finish.LENGTH, 40, 128)
    key = response_key(
        model_id="bench",
        model_version="v",
        tier="edge",
        tokenizer_id="t",
        sampling=SamplingParams(max_tokens=128),
        prompt_ids=list(range(40)),
        tenant="bench",
    )
    raw_key = "bench:raw:response"
    from services.store.response_codec import encode_response

    value = encode_response(resp)
    await cache.put(key, resp)
    await raw.set(raw_key, value, ex=600)
    for _ in range(50):  # warm connections and the script cache
        await cache.get(key)
        await raw.get(raw_key)
    out: dict[str, object] = {"entry_bytes": len(value)}
    out["get"] = await ab_latency(lambda: cache.get(key), lambda: raw.get(raw_key), n)
    out["get_vs_raw_without_timeout"] = await ab_latency(lambda: cache.get(key), lambda: bare.get(raw_key), n)
    same = cache.guard.client  # our layer alone: the very client it wraps, without the layer
    out["get_vs_same_client"] = await ab_latency(lambda: cache.get(key), lambda: same.get(raw_key), n)  # type: ignore[union-attr]
    out["put"] = await ab_latency(lambda: cache.put(key, resp), lambda: raw.set(raw_key, value, ex=600), n)
    ledgered = ResponseCache(cache.guard, ttl_s=600, budget_bytes=64 << 20)
    raw_ledger = ("bench:{raw}:ix", "bench:{raw}:sz", "bench:{raw}:used")
    ledger_key = "bench:{raw}:e"

    async def raw_put_with_budget() -> None:  # the same SET + accounting script, one pipeline
        pipe = raw.pipeline(transaction=False)
        pipe.set(ledger_key, value, ex=600)
        args = (600, int(time.time() * 1000), 64 << 20, len(value))
        pipe.execute_command("EVALSHA", account_script.sha, 4, *raw_ledger, ledger_key, *args)
        await pipe.execute()

    await raw.script_load(account_script.source)
    out["put_with_budget"] = await ab_latency(lambda: ledgered.put(key, resp), raw_put_with_budget, n)
    out["get_concurrent"] = await ab_throughput(lambda: cache.get(key), lambda: raw.get(raw_key), n // 2, 16)
    out["put_concurrent"] = await ab_throughput(
        lambda: cache.put(key, resp), lambda: raw.set(raw_key, value, ex=600), n // 2, 16
    )
    assert cache.stats.errors == 0, "Redis errors during the benchmark; rerun on a quieter machine"
    await cache.close()
    await raw.aclose()
    await bare.aclose()
    return out


def _chain_keys(tokens: Sequence[int], block: int = 16) -> list[str]:
    """What a raw redis-py user needs to name a prefix's blocks: a SHA-256 chain over the blocks."""
    parent, keys = b"\0" * 32, []
    for i in range(0, len(tokens) - block + 1, block):
        parent = hashlib.sha256(parent + b"bench|v|bench" + struct.pack(f"<{block}I", *tokens[i : i + block])).digest()
        keys.append("bench:raw:kv:" + parent.hex())
    return keys


async def bench_kv(url: str, n: int) -> dict[str, object]:
    guard = Guard(redis_from_url(url, 10.0), timeout_s=10.0, service="bench")
    store = KVBlockStore(guard, block_tokens=16, ttl_s=600, max_block_bytes=1 << 20, budget_bytes=1 << 30, timeout_s=10)
    raw = aioredis.Redis.from_url(url)
    rng = np.random.default_rng(0)
    blocks = [rng.standard_normal(BLOCK_SHAPE).astype(np.float16) for _ in range(CHAIN)]
    tokens = list(range(16 * CHAIN))
    ctx = KVContext("bench", "v", "bench")
    mb = sum(b.nbytes for b in blocks) / 1e6

    async def ours_put() -> None:
        assert await store.put(ctx, tokens, blocks) == CHAIN

    async def raw_put() -> None:
        pipe = raw.pipeline(transaction=False)
        for k, b in zip(_chain_keys(tokens), blocks, strict=True):
            pipe.set(k, b.tobytes(), ex=600)
        await pipe.execute()

    raw_kv_ledger = ("bench:{rawkv}:ix", "bench:{rawkv}:sz", "bench:{rawkv}:used")

    async def raw_put_with_budget() -> None:  # the same SETs + the same accounting script, one pipeline
        keys = _chain_keys(tokens)
        values = [b.tobytes() for b in blocks]
        pipe = raw.pipeline(transaction=False)
        for k, v in zip(keys, values, strict=True):
            pipe.set(k, v, ex=600)
        args = (600, int(time.time() * 1000), 1 << 30, *(len(v) for v in values))
        pipe.execute_command("EVALSHA", account_script.sha, 3 + len(keys), *raw_kv_ledger, *keys, *args)
        await pipe.execute()

    async def ours_load() -> None:
        assert len(await store.load(ctx, tokens)) == CHAIN

    async def raw_load() -> None:
        values = await raw.mget(_chain_keys(tokens))
        _ = [np.frombuffer(v, dtype=np.float16).reshape(BLOCK_SHAPE) for v in values]  # type: ignore[arg-type]

    async def ours_match() -> None:
        assert await store.match(ctx, tokens) == CHAIN

    async def raw_match() -> None:  # the same chained SHA-256 keys, one EXISTS (a count, not a prefix)
        await raw.exists(*_chain_keys(tokens))

    await raw.script_load(account_script.source)
    for _ in range(3):
        await ours_put()
        await raw_put()
        await raw_put_with_budget()
        await ours_load()
        await raw_load()
    out: dict[str, object] = {"block_bytes": blocks[0].nbytes, "chain_blocks": CHAIN, "chain_mb": mb}
    ops = (
        ("put", ours_put, raw_put),
        ("put_with_budget", ours_put, raw_put_with_budget),
        ("load", ours_load, raw_load),
    )
    for name, ours, raw_op in ops:
        lat = await ab_latency(ours, raw_op, n)
        lat["ours_mb_s"] = mb / (lat["ours_p50_ms"] / 1000)
        lat["raw_mb_s"] = mb / (lat["raw_p50_ms"] / 1000)
        out[name] = lat
    out["match"] = await ab_latency(ours_match, raw_match, max(20 * n, 500))  # 0.3 ms ops: more samples
    await guard.close()
    await raw.aclose()
    return out


async def bench_mesh(requests: int) -> dict[str, object]:
    """Exact-hit TTFT through a real mesh: the router as its own process, then inside the gateway's."""
    from services.common.pb.meshserve.v1 import inference_pb2 as pb
    from services.local.mesh import Mesh, MeshConfig

    request = pb.GenerateRequest(prompt="Tell me about the sea.", sampling=pb.SamplingParams(max_tokens=32))
    out: dict[str, object] = {}
    for embedded in (False, True):
        config = MeshConfig(edge_workers=1, cloud_workers=1, embed_router=embedded)
        async with Mesh(config, sink=lambda _n, _l: None) as mesh:
            if embedded:
                entries = [("gateway_embedded_router", "gateway", mesh.gateway_address)]
            else:
                entries = [("gateway", "gateway", mesh.gateway_address), ("router", "router", mesh.router_address)]
            for name, kind, address in entries:
                out[name] = await _exact_hits(address, kind, request, requests)
    return out


async def _exact_hits(address: str, kind: str, request: object, requests: int) -> dict[str, object]:
    """The same greedy request ``requests`` + 10 times through ``address`` (gateway or router): TTFT of the hits."""
    import grpc

    from services.common.config import DEFAULT_INTERNAL_TOKEN
    from services.common.pb.meshserve.v1 import inference_pb2_grpc
    from services.local.mesh import DEV_API_KEY

    metadata = {
        "gateway": [("authorization", f"Bearer {DEV_API_KEY}")],
        "router": [("x-meshserve-internal-token", DEFAULT_INTERNAL_TOKEN), ("x-meshserve-tenant", "dev")],
    }[kind]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        ttft: list[float] = []
        hits = tokens = 0
        for i in range(requests + 10):
            t0 = time.perf_counter()
            first = None
            async for frame in stub.Generate(request, metadata=metadata):
                # first frame with tokens (or the final one, should the answer be empty)
                if first is None and (frame.token_ids or frame.HasField("final")):
                    first = time.perf_counter() - t0
                if frame.HasField("final"):
                    hits += frame.final.route.cache_hit
                    tokens = frame.final.usage.completion_tokens
            if i >= 10:  # the first fills the cache; the rest warm the channel
                ttft.append((first or float("nan")) * 1000)
    return {
        "requests": len(ttft),
        "cache_hits": hits,
        "completion_tokens": tokens,
        "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_p99": percentile(ttft, 99),
    }


async def _run(args: argparse.Namespace) -> dict[str, object]:
    report: dict[str, object] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} CPUs, {platform.platform()}, Python {platform.python_version()}",
        "command": "python -m benchmarks.cache.bench " + " ".join(sys.argv[1:]),
        "load_average_start": list(os.getloadavg()),
    }
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_redis(tmp)
        try:
            report["responses"] = await bench_responses(url, args.ops)
            report["kv"] = await bench_kv(url, args.kv_ops)
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    report["load_average_end"] = list(os.getloadavg())
    if not args.skip_mesh:
        report["mesh"] = await bench_mesh(args.requests)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cache.bench", description=__doc__)
    parser.add_argument("--ops", type=int, default=2000, help="response-entry ops per side (default 2000)")
    parser.add_argument("--kv-ops", type=int, default=150, help="KV chain transfers per side (default 150)")
    parser.add_argument("--requests", type=int, default=200, help="mesh requests per entry point (default 200)")
    parser.add_argument("--skip-mesh", action="store_true", help="only the library benchmark")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"), help="output directory")
    args = parser.parse_args(argv)
    report = asyncio.run(_run(args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cache.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    (args.out / "cache.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
