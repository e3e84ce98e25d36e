"""``meshserve bench gateways``: what meshserve's front door adds vs what the LiteLLM proxy adds.

meshserve's gateway cannot relay to an OpenAI-compatible backend (it speaks only to its router and
workers), so each gateway is measured in front of the fastest backend it can have, and what each path
adds is reported against calling that backend directly:

* ``fake_backend`` — :mod:`benchmarks.gateway.fake_openai`: streams ``max_tokens`` chunks at once (aiohttp).
* ``litellm`` — the LiteLLM proxy (``litellm --config``, one process, run from its own virtualenv
  ``.venv-litellm`` because its pins clash with the project's) routing model ``fake`` to that backend:
  HTTP parse, its router, an httpx/openai client call to the backend, SSE re-encoding.
* ``instant_worker`` — a real worker process over :mod:`benchmarks.gateway.instant_worker` (tokens at once),
  called over its internal gRPC API.
* ``meshserve_grpc`` — the gateway with the router in its process (``meshserve up``'s default layout;
  ``--split-router``: gateway process → router process) → that worker: API-key check, rate-limit
  admission and stream lease in Redis, routing, response cache lookup bypassed (temperature 0 but
  unique prompts).
* ``meshserve_http`` — Envoy → OpenAI HTTP adapter → the same gateway → worker.

All paths get the same streamed chat requests (``/v1/chat/completions`` or ``Chat``), closed loop at
``--concurrency``, interleaved in blocks of 10 so machine noise hits all alike.
Added = path p50/p99 minus its backend's p50/p99 (end-to-end). The report's TARGET lines judge each
meshserve front door's added e2e p50 as a ratio to LiteLLM's, same run (gRPC <= 0.1x, HTTP <= 0.2x).
Writes docs/benchmarks/gateways.json/.md.
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
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from benchmarks.gateway.hop_timing import cpu_ns
from benchmarks.gateway.tree_mesh import start_mesh
from benchmarks.load.generator import Result, Sender, Workload, closed_loop, make_items, summarize
from benchmarks.load.senders import grpc_sender, http_sender, worker_sender
from services.cli.client import MeshClient
from services.common.model_paths import model_paths
from services.common.pb.meshserve.internal.v1 import worker_pb2_grpc
from services.common.processes import ServiceProcess, free_port
from services.common.tokenizer import Tokenizer
from services.local.mesh import DEV_API_KEY

LITELLM = Path(".venv-litellm/bin/litellm")
PATHS = {
    "fake_backend": "benchmarks/gateway/fake_openai.py, aiohttp, streams `max_tokens` SSE chunks at once (no model)",
    "litellm": "LiteLLM proxy (one uvicorn worker, master key auth) → fake_backend: parse, route, "
    "httpx/openai call upstream, SSE re-encode",
    "instant_worker": "a real worker process (admission, runner thread, detokenizer) over a synthetic engine "
    "emitting tokens at once, called on its internal gRPC API",
    "meshserve_grpc": "gateway (API key, Redis rate-limit admission + stream lease) with the router (tokenize, "
    "route) in its process, `meshserve up`'s default layout (`--split-router`: the router in its own process) "
    "→ instant_worker, gRPC `Chat`",
    "meshserve_http": "Envoy → OpenAI HTTP adapter → the same gateway → instant_worker",
}
LITELLM_KEY = "sk-meshserve-bench-0123456789abcdef"
BASES = {"litellm": "fake_backend", "meshserve_http": "instant_worker", "meshserve_grpc": "instant_worker"}
TARGETS = {"meshserve_grpc": ("gateways_grpc_vs_litellm", 0.1), "meshserve_http": ("gateways_http_vs_litellm", 0.2)}
"""Per meshserve path: the TARGET line's name and the most its added e2e p50 may be, as a share of LiteLLM's."""
FRONT_DOOR_PROCESSES = {
    "litellm": ("litellm",),
    "meshserve_grpc": ("gateway", "router", "redis"),
    "meshserve_http": ("envoy", "http_adapter", "gateway", "router", "redis"),
}
"""The processes of each front door itself (not its backend): its CPU per request is what the machine's
load does not move, unlike the added wall time."""


def _tree_cpu_ns(pid: int) -> int:
    """CPU ns of ``pid`` and every process below it (LiteLLM's proxy may run its server in a child)."""
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        try:
            total += cpu_ns(current)
            with open(f"/proc/{current}/task/{current}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def _litellm_version() -> str | None:
    """The LiteLLM version in ``.venv-litellm`` (its per-request cost changes between versions)."""
    found = sorted(LITELLM.parent.parent.glob("lib/python*/site-packages/litellm-*.dist-info"))
    return found[-1].name.removeprefix("litellm-").removesuffix(".dist-info") if found else None


def _litellm_config(backend_url: str, tmp: str) -> Path | None:
    """The proxy's config file routing model ``fake`` to ``backend_url``; None if LiteLLM is missing."""
    if not LITELLM.exists():
        return None
    config = Path(tmp) / "litellm.yaml"
    config.write_text(
        "model_list:\n  - model_name: fake\n    litellm_params:\n      model: openai/fake\n"
        f"      api_base: {backend_url}/v1\n      api_key: unused\n"
        "litellm_settings:\n  telemetry: false\n  drop_params: true\n"
    )
    return config


async def _litellm(config: Path | None) -> tuple[ServiceProcess | None, str]:
    """Start the LiteLLM proxy with ``config``; (process, base URL) or (None, why not)."""
    if config is None:
        return None, f"{LITELLM} not found: run `make bench-litellm` (LiteLLM in its own virtualenv)"
    port = free_port()
    env = {
        **os.environ,
        "LITELLM_LOG": "ERROR",
        "LITELLM_TELEMETRY": "False",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # else it fetches a price list from the internet at start
        "LITELLM_MASTER_KEY": LITELLM_KEY,  # the proxy refuses to start without one
        "NO_PROXY": "127.0.0.1",
    }
    argv = [str(LITELLM), "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]
    proc = ServiceProcess("litellm", argv, env, lambda _n, _l: None)
    await proc.spawn()
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as session:
        for _ in range(240):  # up to 120 s: the proxy imports a lot
            if proc.proc is not None and proc.proc.returncode is not None:
                return None, f"the LiteLLM proxy exited with status {proc.proc.returncode} at start"
            try:
                async with session.get(url + "/health/liveliness", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return proc, url
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.5)
    await proc.stop()
    return None, "the LiteLLM proxy did not answer /health/liveliness within 120 s"


async def run(requests: int, concurrency: int, max_tokens: int, split_router: bool = False) -> dict[str, Any]:
    tmp = tempfile.TemporaryDirectory(prefix="meshserve-gateways-")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    fake = ServiceProcess("fake", [sys.executable, "-m", "benchmarks.gateway.fake_openai"], env, lambda _n, _l: None)
    await fake.spawn()
    await fake.wait_started(60)
    fake_url = f"http://{fake.address}"
    litellm, litellm_url = await _litellm(_litellm_config(fake_url, tmp.name))
    mesh = await start_mesh(
        tmp.name,
        layouts=("split",) if split_router else ("embedded",),
        worker_settings={
            "MESHSERVE_INSTANT_WORKER_MAX_ACTIVE_SEQUENCES": "64",
            "MESHSERVE_INSTANT_WORKER_MAX_QUEUE": "64",
        },
        gateway_settings={"MESHSERVE_GATEWAY_MAX_CONCURRENT_STREAMS": "4096"},
    )
    gateway = mesh.procs["gateway" if split_router else "gateway_embedded"]
    from services.controlplane.frontdoor import FrontDoor

    door = FrontDoor([gateway.address], lambda _n, _l: None, timeout_s=120)
    await door.start()
    notes: list[str] = []
    if litellm is None:
        notes.append(f"LiteLLM not measured: {litellm_url}")
    try:
        async with (
            aiohttp.ClientSession() as session,
            MeshClient(gateway.address, DEV_API_KEY) as client,
            grpc.aio.insecure_channel(mesh.procs["worker"].address) as channel,
        ):
            tokenizer = Tokenizer(model_paths().hf_dir)
            senders: dict[str, Sender] = {
                "fake_backend": http_sender(session, fake_url, model="fake"),
                "instant_worker": worker_sender(worker_pb2_grpc.WorkerStub(channel), tokenizer.encode),
                "meshserve_grpc": grpc_sender(client),
                "meshserve_http": http_sender(session, door.base_url.removesuffix("/v1"), api_key=DEV_API_KEY),
            }
            if litellm is not None:
                senders["litellm"] = http_sender(session, litellm_url, model="fake", api_key=LITELLM_KEY)
            workload = Workload(short=0, chat=1, max_tokens=max_tokens, chat_turns=1)
            results: dict[str, list[Result]] = {name: [] for name in senders}
            walls: dict[str, float] = dict.fromkeys(senders, 0.0)
            rng = random.Random(3)
            for send in senders.values():  # warm-up
                await closed_loop(send, make_items(workload, 10, rng, tag=f"w{time.time_ns()}-"), concurrency, 60)
            pids = {"fake": fake, "litellm": litellm, "worker": mesh.procs["worker"], "gateway": gateway}
            pids |= {"redis": mesh.procs["redis"], "envoy": door.envoy.process, "http_adapter": door.adapters[0]}
            pids |= {"router": mesh.procs.get("router")}
            cpu_pids = {n: p.proc.pid for n, p in pids.items() if p is not None and p.proc is not None}
            spent: dict[str, dict[str, int]] = {name: dict.fromkeys(cpu_pids, 0) for name in senders}
            block = 10 * concurrency
            for i in range(max(1, requests // block)):
                for name, send in senders.items():
                    items = make_items(workload, block, rng, tag=f"{name}{i}-{time.time_ns()}-")
                    before = {n: _tree_cpu_ns(pid) for n, pid in cpu_pids.items()}
                    got, wall = await closed_loop(send, items, concurrency, 120)
                    for n, pid in cpu_pids.items():
                        spent[name][n] += _tree_cpu_ns(pid) - before[n]
                    results[name] += got
                    walls[name] += wall
                print(f"\rgateways: block {i + 1}/{max(1, requests // block)}", end="", file=sys.stderr, flush=True)
            print(file=sys.stderr)
    finally:
        await door.stop()
        await mesh.stop()
        if litellm is not None:
            await litellm.stop()
        await fake.stop()
        tmp.cleanup()
    paths = {name: summarize(rs, walls[name]) for name, rs in results.items()}
    cpu = {
        name: {n: round(ns / 1e6 / max(1, len(results[name])), 3) for n, ns in row.items()}
        for name, row in spent.items()
    }
    front_cpu = {
        name: round(sum(cpu[name].get(n, 0.0) for n in procs), 3)
        for name, procs in FRONT_DOOR_PROCESSES.items()
        if name in cpu
    }
    added = {
        name: {
            "p50": round(paths[name]["e2e_ms_p50"] - paths[base]["e2e_ms_p50"], 3),
            "p99": round(paths[name]["e2e_ms_p99"] - paths[base]["e2e_ms_p99"], 3),
            "ttft_p50": round(paths[name]["ttft_ms_p50"] - paths[base]["ttft_ms_p50"], 3),
            "over": base,
        }
        for name, base in BASES.items()
        if name in paths
    }
    return {
        "benchmark": "gateways",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_1m": os.getloadavg()[0]},
        "command": f"meshserve bench gateways --requests {requests} --concurrency {concurrency} "
        f"--max-tokens {max_tokens}" + (" --split-router" if split_router else ""),
        "layout": "split" if split_router else "embedded",
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "paths": paths,
        "added_ms": added,
        "targets": targets(added),
        "cpu_ms_per_request": cpu,
        "front_door_cpu_ms_per_request": front_cpu,
        "litellm_version": _litellm_version(),
        "notes": notes,
        "published_litellm": "p50 2 ms / p99 13 ms added, 4 instances (LiteLLM's docs)",
    }


def targets(added: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per meshserve path: its added e2e p50 over LiteLLM's (same run), the limit, and whether it passes;
    ``ratio`` None (a FAIL) when LiteLLM was not measured or added nothing."""
    litellm = (added.get("litellm") or {}).get("p50")
    out: dict[str, dict[str, Any]] = {}
    for path, (name, limit) in TARGETS.items():
        ours = (added.get(path) or {}).get("p50")
        ratio = round(ours / litellm, 3) if ours is not None and litellm and litellm > 0 else None
        out[name] = {"path": path, "ratio": ratio, "limit": limit, "pass": ratio is not None and ratio <= limit}
        if ratio is None:
            out[name]["why"] = (
                "LiteLLM not measured"
                if litellm is None
                else f"{path} not measured"
                if ours is None
                else "LiteLLM added no time"
            )
    return out


def target_lines(report: dict[str, Any]) -> list[str]:
    """``TARGET <name>: <ratio> (target <= <limit>): PASS|FAIL``, one per meshserve front door."""
    lines = []
    for name, t in (report.get("targets") or targets(report["added_ms"])).items():
        ratio = f"n/a ({t.get('why', 'not measured')})" if t["ratio"] is None else f"{t['ratio']:.3f}"
        lines.append(f"TARGET {name}: {ratio} (target <= {t['limit']:g}): {'PASS' if t['pass'] else 'FAIL'}")
    return lines


def _cpu_lines(report: dict[str, Any]) -> list[str]:
    """CPU ms per request in each front door's own processes, and meshserve's as a share of LiteLLM's."""
    front = report.get("front_door_cpu_ms_per_request")
    if not front:
        return []
    version = report.get("litellm_version") or "?"
    parts = []
    for name, ms in front.items():
        procs = " + ".join(FRONT_DOOR_PROCESSES[name])
        share = f", {ms / front['litellm']:.3f}x LiteLLM's" if name != "litellm" and front.get("litellm") else ""
        parts.append(f"`{name}` {ms:.2f} ms ({procs}{share})")
    return [
        f"LiteLLM {version}. Wall-clock added time grows with the machine's load, and more for the path that",
        "spends more CPU per request; CPU per request in each front door's own processes does not (reference,",
        "not a target): " + "; ".join(parts) + ".",
        "",
    ]


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Gateway overhead: meshserve's front door vs the LiteLLM proxy",
        "",
        f"{report['date']} · {report['machine']['cpus']} CPUs shared by every process here and other work "
        f"(1-min load average {report['machine']['load_avg_1m']:.2f} at the end) · `{report['command']}`",
        "",
        "Streamed chat requests of "
        f"{report['max_tokens']} tokens, closed loop at concurrency {report['concurrency']}, paths interleaved in "
        "blocks. See the module docstring of benchmarks/gateway/vs_litellm.py for exactly what each path includes. "
        f"LiteLLM publishes {report['published_litellm']}. meshserve's layout: "
        + (
            "split (gateway and router in separate processes, `--split-router`)."
            if report.get("layout") == "split"
            else "`meshserve up`'s default, the router embedded in the gateway's process."
        ),
        "",
        "Added e2e p50 of each meshserve front door over its backend, as a share of LiteLLM's over its own (same run):",
        "",
        *target_lines(report),
        "",
        *_cpu_lines(report),
        "| path | requests ok | TTFT p50 | e2e p50 | e2e p95 | e2e p99 | added e2e p50 | added e2e p99 | over |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, s in report["paths"].items():
        a = report["added_ms"].get(name)
        extra = f"{a['p50']:+.2f} | {a['p99']:+.2f} | {a['over']}" if a else " | | (backend)"
        lines.append(
            f"| {name} | {s['ok']}/{s['requests']} | {s['ttft_ms_p50']:.2f} | {s['e2e_ms_p50']:.2f} | "
            f"{s['e2e_ms_p95']:.2f} | {s['e2e_ms_p99']:.2f} | {extra} |"
        )
    lines += [
        "",
        "meshserve's gateway relays only to its router and workers, not to an OpenAI backend, so each gateway",
        "sits in front of the fastest backend it can have and is compared with that backend called directly:",
        "",
        *(f"- `{name}`: {text}" for name, text in PATHS.items()),
        "",
        "Added p99 is a difference of two p99s, not a p99 of differences: under a loaded machine the backend's own",
        "tail can exceed the path's (negative values). LiteLLM runs from `.venv-litellm` (`make bench-litellm`):",
        "it pins openai<3 and huggingface_hub<2, which clash with this project's transformers and dev tools.",
    ]
    lines += [f"\n{note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshserve bench gateways", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="requests per path (default 200)")
    parser.add_argument("--concurrency", type=int, default=1, help="streams at once per path (default 1)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per request (default 16)")
    parser.add_argument(
        "--split-router", action="store_true", help="measure the split layout (router in its own process) instead"
    )
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"), help="output directory")
    args = parser.parse_args(argv)
    report = asyncio.run(run(args.requests, args.concurrency, args.max_tokens, args.split_router))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gateways.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "gateways.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
