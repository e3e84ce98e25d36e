"""Front-door benchmark: what Envoy + the HTTP adapter + the gateway add per request, and cache-hit TTFT.

``python -m benchmarks.gateway.frontdoor [--requests N]`` starts the mesh with its front door (one edge
worker, limits off) and, interleaving the paths request by request so machine noise hits all alike:

1. **Hop overhead** — the same greedy request, answered from the response cache so no model runs,
   sent as unary ``Complete`` to (a) the router directly (internal credential), (b) the gateway,
   (c) Envoy's gRPC route, and as ``POST /v1/completions`` to (d) Envoy's HTTP route. Added latency =
   the path's per-request latency minus the router's (p50/p99 of the latencies, and their difference).
2. **Gateway + router over a direct worker call** — ``Generate`` with ``max_tokens=1``, cache bypassed,
   through the gateway vs. straight to the edge worker (internal API): time to the first token (the
   frame that carries it, also the final frame here), timed alike on both paths.
3. **Cache-hit TTFT** — a cached greedy request streamed over HTTP (SSE, ``/v1/chat/completions``
   and ``/v1/completions``) vs. the gateway's gRPC ``Generate``: time to the first text.

The hop table also has (e) Envoy's gRPC-JSON transcoder in front of the gateway (a second Envoy,
``auto_mapping`` of ``POST /meshserve.v1.Inference/Complete``): the alternative to the Python adapter.
It speaks our proto's JSON, not OpenAI's, so it is measured only to price the adapter.

Writes docs/benchmarks/frontdoor.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import string
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import aiohttp
import grpc

from benchmarks import earlier_runs
from benchmarks.mesh.run import _direct, _encode
from benchmarks.stats import percentile, time_stream
from services.common.config import DEFAULT_INTERNAL_TOKEN
from services.common.pb.meshserve.internal.v1 import worker_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.common.processes import free_port
from services.controlplane.envoy import envoy_binary
from services.local.mesh import DEV_API_KEY, Mesh, MeshConfig

PROMPT = "The capital of France is"
AUTH = (("authorization", f"Bearer {DEV_API_KEY}"),)
INTERNAL = (("x-meshserve-internal-token", DEFAULT_INTERNAL_TOKEN),)
Probe = Callable[[], Awaitable[float]]


def _cached_request(max_tokens: int = 16) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0))


def _timed(fn: Callable[[], Awaitable[object]]) -> Probe:
    async def probe() -> float:
        start = time.perf_counter()
        await fn()
        return (time.perf_counter() - start) * 1000

    return probe


async def _interleaved(probes: dict[str, Probe], requests: int, warmup: int = 20) -> dict[str, list[float]]:
    for _ in range(warmup):
        for probe in probes.values():
            await probe()
    samples: dict[str, list[float]] = {name: [] for name in probes}
    for _ in range(requests):
        for name, probe in probes.items():
            samples[name].append(await probe())
    return samples


def _table(samples: dict[str, list[float]], baseline: str) -> dict[str, dict[str, float]]:
    base50, base99 = percentile(samples[baseline], 50), percentile(samples[baseline], 99)
    rows = {}
    for name, values in samples.items():
        p50, p99 = percentile(values, 50), percentile(values, 99)
        rows[name] = {
            "requests": len(values),
            "p50_ms": round(p50, 3),
            "p99_ms": round(p99, 3),
            "added_p50_ms": round(p50 - base50, 3),
            "added_p99_ms": round(p99 - base99, 3),
        }
    return rows


async def _sse_ttft(session: aiohttp.ClientSession, url: str, body: dict[str, object]) -> float:
    start = time.perf_counter()
    ttft = float("nan")
    async with session.post(url, json=body, headers={"Authorization": f"Bearer {DEV_API_KEY}"}) as reply:
        async for line in reply.content:
            if ttft != ttft and line.startswith(b"data: {") and (b'"content":"' in line or b'"text":"' in line):
                if b'"content":""' not in line and b'"text":""' not in line:
                    ttft = (time.perf_counter() - start) * 1000
    return ttft


def _transcoder_bootstrap(directory: Path, gateway: str, port: int, admin_port: int) -> Path:
    """A standalone Envoy: JSON on ``port`` -> gRPC-JSON transcoder -> the gateway (static)."""
    from grpc_tools import protoc

    descriptor = directory / "inference.pb"
    root = Path(__file__).resolve().parents[2] / "protos"
    proto = root / "meshserve" / "v1" / "inference.proto"
    args = ["protoc", f"-I{root}", "--include_imports", f"--descriptor_set_out={descriptor}", str(proto)]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed to build the descriptor set")
    host, _, gw_port = gateway.rpartition(":")
    template = Path(__file__).with_name("envoy_transcoder.yaml").read_text()
    text = string.Template(template).substitute(
        ADMIN_PORT=admin_port, PORT=port, DESCRIPTOR=descriptor, GATEWAY_HOST=host, GATEWAY_PORT=gw_port
    )
    path = directory / "transcoder.yaml"
    path.write_text(text)
    return path


async def _start_transcoder(gateway: str) -> tuple[asyncio.subprocess.Process, str, tempfile.TemporaryDirectory[str]]:
    tmp = tempfile.TemporaryDirectory(prefix="meshserve-transcoder-")
    port, admin = free_port(), free_port()
    config = _transcoder_bootstrap(Path(tmp.name), gateway, port, admin)
    proc = await asyncio.create_subprocess_exec(
        envoy_binary(),
        "-c",
        str(config),
        "--disable-hot-restart",
        "--concurrency",
        "1",
        "--log-level",
        "error",
        stdin=asyncio.subprocess.DEVNULL,
    )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(f"http://127.0.0.1:{admin}/ready") as reply:
                    if reply.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            if loop.time() > deadline or proc.returncode is not None:
                raise RuntimeError("the transcoder Envoy did not start")
            await asyncio.sleep(0.05)  # bounded poll of Envoy's admin (no watch API)
    return proc, f"http://127.0.0.1:{port}", tmp


async def run(requests: int, embed_router: bool = True) -> dict[str, object]:
    env = {"MESHSERVE_GATEWAY_REQUESTS_PER_MINUTE": "0", "MESHSERVE_GATEWAY_TOKENS_PER_MINUTE": "0"}
    config = MeshConfig(edge_workers=1, cloud_workers=0, envoy=True, extra_env=env, embed_router=embed_router)
    async with Mesh(config, sink=lambda _name, _line: None) as mesh:
        assert mesh.front_door is not None
        base = mesh.http_base_url
        channels = [grpc.aio.insecure_channel(a) for a in (mesh.router_address, mesh.gateway_address)]
        channels.append(grpc.aio.insecure_channel(mesh.front_door.address))
        channels.append(grpc.aio.insecure_channel(mesh.workers("edge")[0].address))
        router, gateway, envoy = (inference_pb2_grpc.InferenceStub(c) for c in channels[:3])
        worker = worker_pb2_grpc.WorkerStub(channels[3])
        connector = aiohttp.TCPConnector(limit=1)
        transcoder, transcoder_url, transcoder_tmp = await _start_transcoder(mesh.gateway_address)
        try:
            async with aiohttp.ClientSession(connector=connector) as session:
                cached = _cached_request()
                await gateway.Complete(cached, metadata=AUTH)  # fills the response cache
                completion = {"model": "", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}

                async def http_complete() -> None:
                    async with session.post(f"{base}/completions", json=completion, headers=dict(AUTH)) as r:
                        assert r.status == 200, await r.text()
                        await r.read()

                proto_json = {"prompt": PROMPT, "sampling": {"maxTokens": 16, "temperature": 0}}

                async def transcoded_complete() -> None:
                    url = f"{transcoder_url}/meshserve.v1.Inference/Complete"
                    async with session.post(url, json=proto_json, headers=dict(AUTH)) as r:
                        assert r.status == 200, await r.text()
                        await r.read()

                hops = await _interleaved(
                    {
                        "router_grpc (baseline)": _timed(lambda: router.Complete(cached, metadata=INTERNAL)),
                        "gateway_grpc": _timed(lambda: gateway.Complete(cached, metadata=AUTH)),
                        "envoy_grpc -> gateway": _timed(lambda: envoy.Complete(cached, metadata=AUTH)),
                        "envoy_http -> adapter -> gateway": _timed(http_complete),
                        "envoy grpc-json transcoder -> gateway (proto JSON)": _timed(transcoded_complete),
                    },
                    requests,
                )

                ids = _encode(PROMPT)
                one = pb.GenerateRequest(
                    prompt=PROMPT,
                    sampling=pb.SamplingParams(max_tokens=1, temperature=0.0),
                    routing=pb.RoutingOptions(tier=pb.TIER_EDGE, cache_policy=pb.CACHE_POLICY_BYPASS),
                )

                # Both paths are timed the same way, to the frame carrying the token (with max_tokens=1
                # the final frame too): the time to first token. The gateway's trailers follow it.
                async def via_gateway() -> float:
                    sample = await time_stream(lambda: gateway.Generate(one, metadata=AUTH))
                    return sample.ttft * 1000

                async def direct() -> float:
                    return (await _direct(worker, ids, 1)).ttft * 1000

                paths: dict[str, Probe] = {
                    "edge_worker direct (baseline)": direct,
                    "gateway -> router -> worker": via_gateway,
                }
                workers = await _interleaved(
                    paths,
                    max(50, requests // 2),
                    warmup=5,
                )

                async def grpc_ttft() -> float:
                    start = time.perf_counter()
                    async for frame in gateway.Generate(cached, metadata=AUTH):
                        if frame.text:
                            return (time.perf_counter() - start) * 1000
                    return float("nan")

                chat = {"model": "", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16}
                chat |= {"temperature": 0, "stream": True}
                await session.post(f"{base}/chat/completions", json={**chat, "stream": False}, headers=dict(AUTH))
                ttft = await _interleaved(
                    {
                        "gateway_grpc Generate (baseline)": grpc_ttft,
                        "http SSE /v1/completions": lambda: _sse_ttft(
                            session, f"{base}/completions", {**completion, "stream": True}
                        ),
                        "http SSE /v1/chat/completions": lambda: _sse_ttft(session, f"{base}/chat/completions", chat),
                    },
                    requests,
                )
        finally:
            for channel in channels:
                await channel.close()
            transcoder.terminate()
            await transcoder.wait()
            transcoder_tmp.cleanup()
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_implementation()} "
        f"{platform.python_version()}",
        "requests_per_path": requests,
        "hop_overhead_cache_hit_complete": _table(hops, "router_grpc (baseline)"),
        "gateway_router_over_worker_max_tokens_1": _table(workers, "edge_worker direct (baseline)"),
        "cache_hit_ttft": _table(ttft, "gateway_grpc Generate (baseline)"),
    }


def _markdown(report: dict[str, object]) -> str:
    lines = [
        "# Front door: Envoy + HTTP adapter + gateway overhead",
        "",
        f"{report['date']} on {report['machine']}; {report['requests_per_path']} requests per path, interleaved.",
        "Reproduce: `.venv/bin/python -m benchmarks.gateway.frontdoor"
        + ("`" if report.get("embed_router") else " --split-router`")
        + ". All latencies in ms; *added* = this path minus the baseline row (p50 minus p50, p99 minus p99).",
        "Layout: "
        + (
            "the router inside the gateway's process (`meshserve up`, the default)."
            if report.get("embed_router")
            else "gateway and router as separate processes (`meshserve up --split-router`)."
        )
        + " Router to worker over the stream transport (docs/router.md).",
    ]
    titles = {
        "hop_overhead_cache_hit_complete": "Per-request latency, cache-hit unary Complete (no model runs)",
        "gateway_router_over_worker_max_tokens_1": "Gateway + router over a direct worker call, TTFT (max_tokens=1)",
        "cache_hit_ttft": "Cache-hit TTFT (first text) over HTTP SSE vs gRPC",
    }
    for key, title in titles.items():
        rows = report[key]
        assert isinstance(rows, dict)
        lines += ["", f"## {title}", "", "| path | p50 | p99 | added p50 | added p99 |", "|---|---|---|---|---|"]
        for name, row in rows.items():
            lines.append(
                f"| {name} | {row['p50_ms']:.2f} | {row['p99_ms']:.2f} | {row['added_p50_ms']:+.2f} | "
                f"{row['added_p99_ms']:+.2f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gateway.frontdoor", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=400, help="measured requests per path (default 400)")
    parser.add_argument(
        "--split-router",
        action="store_true",
        help="the router as its own process (meshserve up --split-router); writes frontdoor_split.*",
    )
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"), help="output directory")
    args = parser.parse_args(argv)
    report = asyncio.run(run(args.requests, embed_router=not args.split_router))
    report["embed_router"] = not args.split_router
    stem = "frontdoor_split" if args.split_router else "frontdoor"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    markdown = _markdown(report)
    earlier_runs.write(args.out / f"{stem}.md", markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
