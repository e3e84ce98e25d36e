"""Router prefix-cache benchmark with real workers: multi-turn chats sharing system prompts,
cache-aware routing vs round-robin, prefix-cache hit rate and TTFT.

For each routing policy a fresh mesh is started with `meshserve up`'s launcher (:class:`Mesh`):
``--replicas`` workers of one tier (default: cloud, the gpu_worker engine with its local prefix KV
cache), registering with the router by heartbeat, no front door. Fresh workers per policy mean both
start with empty caches. Clients call the router directly (internal credential, as the gateway
does) so the gateway's rate limits stay out of the numbers.

Workload: ``--conversations`` conversations, each under one of ``--system-prompts`` shared system
prompts, ``--turns`` turns each; every turn is a stateless Generate whose prompt is the whole
conversation so far rendered by the chat template (system + earlier turns + answers), as an
OpenAI-style client sends it. ``--concurrency`` conversations run at once. Greedy, response cache
bypassed.

Prefix hit rate is what the workers report, not what the router believes: 1 - (prefill tokens run)
/ (prompt tokens), from the ``Worker.Stats`` counters. Cloud workers get the shared Redis KV prefix
cache exactly when `meshserve up` gives it to them; the report says which. TTFT is measured by the client (router +
worker). The router's own replica decisions come from its metrics endpoint.

Run: ``.venv/bin/python -m benchmarks.router.prefix`` (minutes on CPU). Writes
docs/benchmarks/router_prefix.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import random
import statistics
import sys
import urllib.request
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import grpc

from benchmarks import earlier_runs
from benchmarks.stats import percentile, time_stream
from services.common.config import DEFAULT_INTERNAL_TOKEN
from services.common.model_paths import model_paths
from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.tokenizer import Tokenizer
from services.local.mesh import Mesh, MeshConfig

OUT = Path("docs/benchmarks")
POLICIES = ("round_robin", "cache_aware")
META = (("x-meshserve-internal-token", DEFAULT_INTERNAL_TOKEN), ("x-meshserve-tenant", "bench"))
WORDS = (
    "the river valley town market bridge harbour ship sailor weather rain wind stone road forest hill "
    "farmer bread school library music garden winter summer lantern window story morning evening "
    "engine signal station letter journey mountain island coast tower clock field orchard"
).split()


@dataclass
class Workload:
    replicas: int = 3
    tier: str = "cloud"
    system_prompts: int = 4
    system_words: int = 220
    conversations: int = 18
    turns: int = 3
    user_words: int = 18
    max_tokens: int = 12
    concurrency: int = 6
    kv_budget_mb: int = 48
    """KV budget of each cloud worker (live sequences + its prefix LRU); small enough that a replica
    cannot keep every system prompt, as in production where prompts outnumber what fits."""
    threads: int = 1
    seed: int = 11


def conversations(cfg: Workload) -> list[tuple[str, list[str]]]:
    """(system prompt, user messages) per conversation; deterministic for a seed."""
    rng = random.Random(cfg.seed)
    systems = [
        f"You are assistant number {i}. Background for this session: "
        + " ".join(rng.choice(WORDS) for _ in range(cfg.system_words))
        for i in range(cfg.system_prompts)
    ]
    out = []
    for c in range(cfg.conversations):
        users = [
            f"Question {t}: " + " ".join(rng.choice(WORDS) for _ in range(cfg.user_words)) + "?"
            for t in range(cfg.turns)
        ]
        out.append((systems[c % cfg.system_prompts], users))
    rng.shuffle(out)
    return out


async def _run_policy(policy: str, cfg: Workload, tokenizer: Tokenizer) -> dict[str, Any]:
    config = MeshConfig(  # its own fresh redis-server too
        edge_workers=cfg.replicas if cfg.tier == "edge" else 0,
        cloud_workers=cfg.replicas if cfg.tier == "cloud" else 0,
        envoy=False,
        edge_threads=cfg.threads,
        cloud_threads=cfg.threads,
        extra_env={
            "MESHSERVE_ROUTER_ROUTING_POLICY": policy,
            "MESHSERVE_ROUTER_TTFT_SLO_MS": "0",
            "MESHSERVE_GPU_WORKER_KV_BUDGET_BYTES": str(cfg.kv_budget_mb << 20),
        },
    )
    async with Mesh(config, sink=_sink) as mesh:
        work = asyncio.Queue[tuple[str, list[str]]]()
        for conv in conversations(cfg):
            work.put_nowait(conv)
        samples: list[tuple[int, float]] = []  # (turn, ttft s)
        async with grpc.aio.insecure_channel(mesh.router_address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)

            async def client() -> None:
                while not work.empty():
                    system, users = work.get_nowait()
                    messages = [{"role": "system", "content": system}]
                    for turn, user in enumerate(users):
                        messages.append({"role": "user", "content": user})
                        request = pb.GenerateRequest(
                            prompt=tokenizer.render_chat(messages),
                            sampling=pb.SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0),
                            routing=pb.RoutingOptions(
                                tier=pb.TIER_CLOUD if cfg.tier == "cloud" else pb.TIER_EDGE,
                                cache_policy=pb.CACHE_POLICY_BYPASS,
                            ),
                        )
                        text: list[str] = []
                        sample = await time_stream(partial(_frames, stub, request, text))
                        samples.append((turn, sample.ttft))
                        messages.append({"role": "assistant", "content": "".join(text)})

            await asyncio.gather(*(client() for _ in range(cfg.concurrency)))
        per_worker = {}
        for proc in mesh.workers(cfg.tier):
            async with grpc.aio.insecure_channel(proc.address) as channel:
                s = await worker_pb2_grpc.WorkerStub(channel).Stats(
                    worker_pb2.StatsRequest(), metadata=META, timeout=10
                )
            per_worker[proc.name] = {
                "requests": s.sequences_started_total,
                "prompt_tokens": s.prompt_tokens_total,
                "prefill_tokens": s.prefill_tokens_total,
            }
        decisions = _replica_decisions(mesh.router_process.metrics_port)
        redis_kv = any(p.env.get("MESHSERVE_GPU_WORKER_REDIS_URL") for p in mesh.workers(cfg.tier))
    prompt = sum(w["prompt_tokens"] for w in per_worker.values())
    prefill = sum(w["prefill_tokens"] for w in per_worker.values())
    ttft = [t * 1000 for _, t in samples]
    later = [t * 1000 for turn, t in samples if turn > 0]
    return {
        "requests": len(samples),
        "prefix_hit_rate": 1 - prefill / prompt if prompt else 0.0,
        "prompt_tokens": prompt,
        "prefill_tokens": prefill,
        "ttft_ms_mean": statistics.fmean(ttft),
        "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_p99": percentile(ttft, 99),
        "later_turns_ttft_ms_p50": percentile(later, 50),
        "per_worker": per_worker,
        "router_replica_decisions": decisions,
        "redis_kv_prefix_cache": redis_kv,
    }


async def _frames(stub: inference_pb2_grpc.InferenceStub, request: pb.GenerateRequest, text: list[str]) -> Any:
    async for frame in stub.Generate(request, metadata=META):
        text.append(frame.text)
        yield frame


def _sink(name: str, line: str) -> None:
    if '"level": "error"' in line:
        sys.stderr.write(f"{name} | {line}\n")


def _replica_decisions(port: int | None) -> dict[str, float]:
    """meshserve_router_replica_decisions_total by reason, scraped from the router's /metrics."""
    if not port:
        return {}
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in body.splitlines():
        if line.startswith("meshserve_router_replica_decisions_total{"):
            labels, value = line.rsplit(" ", 1)
            reason = labels.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(value)
    return out


def _markdown(report: dict[str, Any]) -> str:
    cfg = report["workload"]
    redis = "yes" if report["rounds"][0]["round_robin"].get("redis_kv_prefix_cache") else "no"
    lines = [
        "# Router prefix-cache benchmark (real workers)",
        "",
        f"{report['date']} · {report['machine']} · `.venv/bin/python -m benchmarks.router.prefix`",
        "",
        f"{cfg['replicas']} {cfg['tier']} workers (`meshserve up`'s launcher, registered by heartbeat), "
        f"{cfg['conversations']} conversations x {cfg['turns']} turns under {cfg['system_prompts']} shared "
        f"system prompts (~{cfg['system_words']} words each), {cfg['concurrency']} at once, "
        f"{cfg['max_tokens']} greedy tokens per turn; every turn resends the whole conversation; "
        f"{cfg['kv_budget_mb']} MiB KV budget per cloud worker (live sequences + local prefix LRU); "
        f"shared Redis KV prefix cache (as `meshserve up` configures cloud workers): {redis}. "
        "Hit rate = prompt tokens the workers did not have to prefill (KV held locally, or imported "
        "from Redis where shared), from their own counters; prefill = prompt tokens they computed. "
        "Policies alternate, one fresh mesh per run; "
        "load = the machine's 1-minute load average when the run ended.",
        "",
        "| round | policy | prefix hit rate | prefill tokens | TTFT mean (ms) | p50 | p99 | requests per worker "
        "| load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, rnd in enumerate(report["rounds"]):
        for name in POLICIES:
            r = rnd[name]
            spread = ", ".join(str(w["requests"]) for w in r["per_worker"].values())
            lines.append(
                f"| {i + 1} | {name} | {r['prefix_hit_rate']:.1%} | {r['prefill_tokens']} | "
                f"{r['ttft_ms_mean']:.0f} | {r['ttft_ms_p50']:.0f} | {r['ttft_ms_p99']:.0f} | {spread} | "
                f"{r['load_avg']:.1f} |"
            )
    decisions = report["rounds"][-1]["cache_aware"]["router_replica_decisions"]
    prefill = [rnd["cache_aware"]["prefill_tokens"] / rnd["round_robin"]["prefill_tokens"] for rnd in report["rounds"]]
    ttft = [rnd["cache_aware"]["ttft_ms_mean"] / rnd["round_robin"]["ttft_ms_mean"] for rnd in report["rounds"]]
    lines += [
        "",
        "Cache-aware vs round-robin, per round: prefill tokens "
        + ", ".join(f"{100 * (x - 1):+.0f} %" for x in prefill)
        + "; TTFT mean "
        + ", ".join(f"{100 * (x - 1):+.0f} %" for x in ttft)
        + " (anchor: Ray Serve reports -60 % TTFT).",
        f"Router replica decisions (cache-aware, last round): {decisions}.",
        "",
    ]
    return "\n".join(lines)


async def _main(cfg: Workload, rounds: int) -> dict[str, Any]:
    tokenizer = Tokenizer(model_paths().hf_dir)
    report: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared)",
        "workload": asdict(cfg),
        "rounds": [],
    }
    for i in range(rounds):
        rnd: dict[str, Any] = {}
        for policy in POLICIES if i % 2 == 0 else tuple(reversed(POLICIES)):
            rnd[policy] = await _run_policy(policy, cfg, tokenizer)
            rnd[policy]["load_avg"] = os.getloadavg()[0]
        report["rounds"].append(rnd)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = Workload()
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each policy, alternating")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--name", default="router_prefix", help="file stem of the report (.json, .md)")
    args = parser.parse_args()
    cfg = Workload(**{k: getattr(args, k) for k in asdict(defaults)})
    report = asyncio.run(_main(cfg, args.rounds))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(report, indent=2) + "\n")
    earlier_runs.write(args.out / f"{args.name}.md", _markdown(report))
    print(_markdown(report))


if __name__ == "__main__":
    main()
