"""What the gateway and router hops cost, isolated from model compute.

``python -m benchmarks.gateway.hops`` (also part of ``meshserve bench``) starts, as separate processes like
``meshserve up`` does: redis-server, one real worker process running a synthetic engine that emits
tokens at once (:mod:`benchmarks.gateway.instant_worker`: the real worker runtime, no model time), the real
router and the real gateway (API keys, rate limits in Redis, stream leases all on). Then:

1. **Added latency.** The same greedy request (response cache bypassed) sent request by request,
   each round in a new seeded order (no path always follows the one whose tail work overlaps it):
   straight to the worker, to the router, to the gateway (static key, stored key, router embedded)...
   TTFT and total time, p50/p99 per path; *added* = path minus direct (p50 - p50, p99 - p99). The
   per-frame relay cost is (added total - added TTFT) / (frames - 1), from the medians. Two chains
   of two bare relays (:mod:`benchmarks.gateway.bare_relay`) give the floor of two Python gRPC hops, one on
   grpc.aio (what the services use) and one on grpc's synchronous API (threads).
   Then **paired** (:mod:`benchmarks.gateway.hops_pairs`): each path alone against the direct call,
   alternated request by request, so the hop's process is as warm as the worker (the round robin
   leaves it idle seven requests in eight); issue 3's target is read from the paired numbers.
2. **CPU per request.** The same paths again, in blocks of 10 requests per path taken in turn,
   reading every process's CPU time (all threads, ns, /proc schedstat) around each block: ms of CPU
   per request in the client, the gateway, the router, the worker and Redis (steadier than wall time).
3. **Exact cache hit.** A cached greedy request streamed through the router and through the
   gateway: TTFT (first token) p50/p99 (issue 4's target: p50 ≤ 3 ms over gRPC through the mesh).

``--ab-tree TREE`` (a checkout of other code, e.g. ``git worktree add /tmp/before <commit>``) runs
:mod:`benchmarks.gateway.hops_ab` instead: two whole meshes, this tree's and TREE's, side by side in one run,
their requests interleaved (hops_ab.json/.md).
``--profile DIR`` runs router and gateway under cProfile (DIR/<service>.prof). Writes hops.json/.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import platform
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import redis.asyncio as aioredis

from benchmarks.gateway.hop_timing import INTERNAL, PROMPT, cpu_per_request, latency_samples, stream_call, worker_call
from benchmarks.gateway.hops_pairs import Probe, paired, summary
from benchmarks.gateway.hops_report import markdown, write_report
from services.common.model_paths import model_paths
from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.processes import ServiceProcess
from services.common.tokenizer import Tokenizer
from services.gateway.keystore import KeyStore
from services.local.mesh import DEV_API_KEY, api_key_hash
from services.local.redis_server import spawn_redis

__all__ = ["markdown", "run", "start_stack", "write_report"]


@dataclass
class Stack:
    redis: ServiceProcess
    worker: ServiceProcess
    router: ServiceProcess
    gateway: ServiceProcess
    relays: list[ServiceProcess]
    sync_relays: list[ServiceProcess]
    """The same two bare relays on grpc's synchronous API (``bare_relay.py``'s sync mode)."""
    redis_url: str
    tmp: tempfile.TemporaryDirectory[str]
    more: dict[str, ServiceProcess]
    """More services: ``gateway_embedded`` (router in its process)."""

    def processes(self) -> dict[str, ServiceProcess]:
        procs = {"gateway": self.gateway, "router": self.router, "worker": self.worker, "redis": self.redis}
        relays = {f"relay{i}": r for i, r in enumerate(self.relays)}
        return procs | self.more | relays | {f"relay_sync{i}": r for i, r in enumerate(self.sync_relays)}

    async def stop(self) -> None:
        relays = (*self.relays, *self.sync_relays)
        for proc in (self.gateway, self.router, *self.more.values(), *relays, self.worker, self.redis):
            await proc.stop()
        self.tmp.cleanup()


def _argv(module: str, profile_dir: Path | None, name: str) -> list[str]:
    if profile_dir is None:
        return [sys.executable, "-m", module]
    return [sys.executable, "-m", "benchmarks.profiled", str(profile_dir / f"{name}.prof"), module]


async def _start(proc: ServiceProcess, health: bool = True) -> ServiceProcess:
    """Spawn; wait for its ``service_started`` line and, with ``health``, for SERVING."""
    await proc.spawn()
    await proc.wait_started(120)
    if health:
        await proc.wait_serving(120)
    return proc


async def start_stack(profile_dir: Path | None = None, redis_batch: bool = True) -> Stack:
    """redis-server, instant worker, router, gateway, embedded gateway: separate processes."""
    sink: Callable[[str, str], None] = lambda _name, _line: None  # noqa: E731
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    tmp = tempfile.TemporaryDirectory(prefix="meshserve-hops-")
    redis_proc, redis_url = await spawn_redis(tmp.name, sink, env, batch=redis_batch)  # as `meshserve up` runs it
    worker_env = {"MESHSERVE_INSTANT_WORKER_MAX_ACTIVE_SEQUENCES": "8", "MESHSERVE_INSTANT_WORKER_WORKER_ID": "instant"}
    worker = await _start(
        ServiceProcess("worker", [sys.executable, "-m", "benchmarks.gateway.instant_worker"], env | worker_env, sink)
    )
    router_env = env | {"MESHSERVE_ROUTER_EDGE_WORKERS": worker.address, "MESHSERVE_ROUTER_REDIS_URL": redis_url}
    gateway_env = env | {
        "MESHSERVE_GATEWAY_API_KEYS": f"dev:{api_key_hash(DEV_API_KEY)}",
        "MESHSERVE_GATEWAY_REDIS_URL": redis_url,
        # Limits stay on (every request runs the admission script and, for streams, a lease)
        # but high enough that the benchmark's own traffic never hits them.
        "MESHSERVE_GATEWAY_REQUESTS_PER_MINUTE": "100000000",
        "MESHSERVE_GATEWAY_TOKENS_PER_MINUTE": "1000000000",
    }
    services: dict[str, ServiceProcess] = {}
    router = await _start(ServiceProcess("router", _argv("services.router", profile_dir, "router"), router_env, sink))
    services["router"] = router
    services["gateway"] = await _start(
        ServiceProcess(
            "gateway",
            _argv("services.gateway", profile_dir, "gateway"),
            gateway_env | {"MESHSERVE_GATEWAY_ROUTER_ADDRESS": router.address},
            sink,
        )
    )
    chains: dict[str, list[ServiceProcess]] = {"relay": [], "relay_sync": []}
    for name, chain in chains.items():  # two bare relays chained: the floor of two Python gRPC hops
        upstream = worker.address
        mode = {"MESHSERVE_BARE_RELAY_SYNC": "1"} if name == "relay_sync" else {}
        for i in range(2):
            relay_env = env | mode | {"MESHSERVE_BARE_RELAY_UPSTREAM": upstream}
            relay = ServiceProcess(
                f"{name}{i}", [sys.executable, "-m", "benchmarks.gateway.bare_relay"], relay_env, sink
            )
            chain.append(await _start(relay, health=False))
            upstream = relay.address
    # The same gateway with the router embedded in its process (no gateway -> router gRPC hop).
    embedded_env = gateway_env | router_env | {"MESHSERVE_GATEWAY_EMBED_ROUTER": "1", "MESHSERVE_ROUTER_PORT": "0"}
    services["gateway_embedded"] = await _start(
        ServiceProcess(
            "gateway_embedded", _argv("services.gateway", profile_dir, "gateway_embedded"), embedded_env, sink
        )
    )
    router, gateway = services.pop("router"), services.pop("gateway")
    return Stack(redis_proc, worker, router, gateway, chains["relay"], chains["relay_sync"], redis_url, tmp, services)


def _probes(
    stubs: dict[str, Any], ids: list[int], keystore_key: str, max_tokens: int, cached: bool
) -> dict[str, Probe]:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    routing = pb.RoutingOptions(
        tier=pb.TIER_EDGE, cache_policy=pb.CACHE_POLICY_USE if cached else pb.CACHE_POLICY_BYPASS
    )
    request = pb.GenerateRequest(prompt=PROMPT, sampling=sampling, routing=routing)
    start = worker_pb2.WorkerRequest(
        start=worker_pb2.WorkerStart(request_id="bench", prompt_token_ids=ids, sampling=sampling)
    )

    def via(stub: Any, metadata: Sequence[tuple[str, str]]) -> Probe:
        return lambda: stream_call(stub.Generate(request, metadata=metadata))

    probes: dict[str, Probe] = {}
    if not cached:
        probes["direct_worker"] = lambda: worker_call(stubs["worker"], start)
        probes["bare_relay_x2 (floor)"] = lambda: worker_call(stubs["relay"], start)
        probes["bare_relay_x2_sync_api"] = lambda: worker_call(stubs["relay_sync"], start)
    static = (("authorization", f"Bearer {DEV_API_KEY}"),)
    stored = (("authorization", f"Bearer {keystore_key}"),)
    probes["router"] = via(stubs["router"], INTERNAL)
    probes["gateway_static_key"] = via(stubs["gateway"], static)
    probes["gateway_stored_key"] = via(stubs["gateway"], stored)
    if "gateway_embedded" in stubs:
        probes["gateway_embedded_router"] = via(stubs["gateway_embedded"], static)
    return probes


def _pids(procs: dict[str, ServiceProcess]) -> dict[str, int]:
    """Every process's pid by name, and the client's (this process)."""
    return {name: p.proc.pid for name, p in procs.items() if p.proc is not None} | {"client": os.getpid()}


async def run(
    requests: int = 400,
    cpu_requests: int = 300,
    max_tokens: int = 16,
    profile_dir: Path | None = None,
    redis_batch: bool = True,
) -> dict[str, Any]:
    stack = await start_stack(profile_dir, redis_batch)
    channels: list[grpc.aio.Channel] = []
    try:
        client = aioredis.Redis.from_url(stack.redis_url)
        try:
            keystore_key, _record = await KeyStore(client).create("bench", name="hops benchmark")
        finally:
            await client.aclose()
        targets = {
            "worker": stack.worker,
            "relay": stack.relays[-1],
            "relay_sync": stack.sync_relays[-1],
            "router": stack.router,
            "gateway": stack.gateway,
        }
        stubs: dict[str, Any] = {}
        for name, proc in (targets | stack.more).items():
            channels.append(grpc.aio.insecure_channel(proc.address))
            kind = (
                worker_pb2_grpc.WorkerStub if name.startswith(("worker", "relay")) else inference_pb2_grpc.InferenceStub
            )
            stubs[name] = kind(channels[-1])
        ids = Tokenizer(model_paths().hf_dir).encode(PROMPT)
        probes = _probes(stubs, ids, keystore_key, max_tokens, cached=False)
        latency = await latency_samples(probes, requests, warmup=30)
        pairs = await paired(probes, "direct_worker", requests)
        cpu = await cpu_per_request(probes, _pids(stack.processes()), cpu_requests)
        hit_probes = _probes(stubs, ids, keystore_key, max_tokens, cached=True)
        hits = await latency_samples(hit_probes, requests, warmup=10)
        hit_cpu = await cpu_per_request(hit_probes, _pids(stack.processes()), cpu_requests)
    finally:
        for channel in channels:
            await channel.close()
        await stack.stop()
    base = latency["direct_worker"]
    return {
        "benchmark": "hops",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_avg_1m": os.getloadavg()[0],
        },
        "command": f"python -m benchmarks.gateway.hops --requests {requests} --cpu-requests {cpu_requests} "
        f"--max-tokens {max_tokens}" + ("" if redis_batch else " --redis-normal"),
        "redis_sched_batch": redis_batch,
        "max_tokens": max_tokens,
        "latency": {name: summary(s, None if name == "direct_worker" else base) for name, s in latency.items()},
        "paired": pairs,
        "cpu_ms_per_request": cpu,
        "cache_hit": {name: summary(s, None) for name, s in hits.items()},
        "cache_hit_cpu_ms_per_request": hit_cpu,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gateway.hops", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400, help="interleaved requests per path (default 400)")
    parser.add_argument("--cpu-requests", type=int, default=300, help="requests per path for CPU time (default 300)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per request (default 16)")
    parser.add_argument("--profile", type=Path, default=None, help="write cProfile output of router and gateway here")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"), help="output directory")
    parser.add_argument(
        "--ab-tree",
        type=Path,
        default=None,
        help="A/B: also run a mesh from this source tree (e.g. a `git worktree` of an earlier commit; this tree's own "
        "path for an A/A run), interleaved with this tree's; writes hops_ab.json/.md (benchmarks/gateway/hops_ab.py)",
    )
    parser.add_argument("--redis-normal", action="store_true", help="Redis without SCHED_BATCH (for an A/B run)")
    args = parser.parse_args(argv)
    if args.ab_tree is not None:
        from benchmarks.gateway import hops_ab
        from benchmarks.gateway.tree_mesh import check_tree

        tree = check_tree(args.ab_tree, "hops --ab-tree")
        ab = asyncio.run(hops_ab.run(tree, args.requests, args.cpu_requests, args.max_tokens))
        hops_ab.write_report(ab, args.out)
        print(hops_ab.markdown(ab))
        return 0
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    report = asyncio.run(run(args.requests, args.cpu_requests, args.max_tokens, args.profile, not args.redis_normal))
    if args.profile is None:
        write_report(report, args.out)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
