"""`meshserve bench`: what the mesh adds over calling a worker directly — hops alone, then per tier.

First :mod:`benchmarks.gateway.hops`: gateway + router over a direct call to a real worker process whose
synthetic engine emits tokens at once, so the hops' own cost (a few ms) is not buried under model
time; writes docs/benchmarks/hops.md/.json. Then, with the real models: starts the local
mesh (same launcher as `meshserve up`), then for each tier sends the same greedy
requests (response cache bypassed) alternately (a) through gateway -> router -> worker and
(b) straight to one worker of that tier over the internal API, measuring TTFT, inter-token
latency and per-stream decode tokens/s. Prints a table and writes JSON + Markdown to
docs/benchmarks/.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from benchmarks.stats import StreamSample, summarize, time_stream
from services.common.config import DEFAULT_INTERNAL_TOKEN
from services.common.model_paths import model_paths
from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.local.mesh import DEV_API_KEY, Mesh, MeshConfig

PROMPTS = {
    "edge": "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "cloud": " ".join(["The history of the river valley and the towns along it is long and full of change."] * 12),
}
TIERS = {"edge": pb.TIER_EDGE, "cloud": pb.TIER_CLOUD}


async def _through_mesh(stub: inference_pb2_grpc.InferenceStub, tier: str, max_tokens: int) -> StreamSample:
    request = pb.GenerateRequest(
        prompt=PROMPTS[tier],
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0),
        routing=pb.RoutingOptions(tier=TIERS[tier], cache_policy=pb.CACHE_POLICY_BYPASS),
    )
    return await time_stream(lambda: stub.Generate(request, metadata=(("authorization", f"Bearer {DEV_API_KEY}"),)))


async def _direct(stub: worker_pb2_grpc.WorkerStub, ids: list[int], max_tokens: int) -> StreamSample:
    start_msg = worker_pb2.WorkerRequest(
        start=worker_pb2.WorkerStart(
            request_id="bench", prompt_token_ids=ids, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0)
        )
    )
    done = asyncio.Event()

    async def requests():  # type: ignore[no-untyped-def]
        yield start_msg
        await done.wait()

    calls = []

    def open_call() -> Any:
        calls.append(stub.Generate(requests(), metadata=(("x-meshserve-internal-token", DEFAULT_INTERNAL_TOKEN),)))
        return calls[0]

    sample = await time_stream(open_call)
    done.set()
    calls[0].cancel()
    return sample


def _encode(text: str) -> list[int]:
    from tokenizers import Tokenizer

    return list(Tokenizer.from_file(str(model_paths().hf_dir / "tokenizer.json")).encode(text).ids)


async def run(requests: int, max_tokens: int) -> dict[str, object]:
    config = MeshConfig(edge_workers=2, cloud_workers=1)
    results: dict[str, object] = {}
    async with Mesh(config, sink=lambda _name, _line: None) as mesh:
        async with grpc.aio.insecure_channel(mesh.gateway_address) as gw_channel:
            gateway = inference_pb2_grpc.InferenceStub(gw_channel)
            for tier in ("edge", "cloud"):
                worker_address = mesh.workers(tier)[0].address
                async with grpc.aio.insecure_channel(worker_address) as w_channel:
                    worker = worker_pb2_grpc.WorkerStub(w_channel)
                    ids = _encode(PROMPTS[tier])
                    await _through_mesh(gateway, tier, 4)  # warm both paths
                    await _direct(worker, ids, 4)
                    via_mesh: list[StreamSample] = []
                    direct: list[StreamSample] = []
                    for i in range(requests):
                        print(f"\r{tier}: request {i + 1}/{requests}", end="", file=sys.stderr, flush=True)
                        via_mesh.append(await _through_mesh(gateway, tier, max_tokens))
                        direct.append(await _direct(worker, ids, max_tokens))
                    print(file=sys.stderr)
                    results[tier] = {
                        "prompt_tokens": len(ids),
                        "mesh": summarize(via_mesh),
                        "direct_worker": summarize(direct),
                    }
    report = {
        "benchmark": "mesh_overhead",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "command": f"meshserve bench --requests {requests} --max-tokens {max_tokens}",
        "requests_per_path": requests,
        "max_tokens": max_tokens,
        "results": results,
    }
    return report


def write_report(report: dict[str, object], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "mesh_overhead.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "mesh_overhead.md").write_text(_markdown(report))


def _markdown(report: dict[str, object]) -> str:
    lines = [
        "# Mesh overhead: through gateway + router vs the worker called directly",
        "",
        f"Measured {report['date']} on {report['machine']} with `{report['command']}`.",  # type: ignore[index]
        "Greedy requests, response cache bypassed; the two paths alternate request by request.",
        "",
        "| tier | path | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) | decode tok/s per stream |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    results = report["results"]
    assert isinstance(results, dict)
    for tier, data in results.items():
        for path in ("mesh", "direct_worker"):
            s = data[path]
            lines.append(
                f"| {tier} | {path} | {s['ttft_ms_p50']:.1f} | {s['ttft_ms_p99']:.1f} | {s['itl_ms_p50']:.2f} | "
                f"{s['itl_ms_p99']:.2f} | {s['decode_tokens_per_s']:.1f} |"
            )
        m, d = data["mesh"], data["direct_worker"]
        lines.append(
            f"| {tier} | **mesh adds** | {m['ttft_ms_p50'] - d['ttft_ms_p50']:+.1f} | "
            f"{m['ttft_ms_p99'] - d['ttft_ms_p99']:+.1f} | {m['itl_ms_p50'] - d['itl_ms_p50']:+.2f} | "
            f"{m['itl_ms_p99'] - d['itl_ms_p99']:+.2f} | {m['decode_tokens_per_s'] - d['decode_tokens_per_s']:+.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshserve bench", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20, help="requests per tier and path (default 20)")
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="tokens generated per request (default 64; cloud: 32)"
    )
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"), help="output directory")
    parser.add_argument(
        "--only",
        choices=("hops", "model", "cloud"),
        default=None,
        help="run only the hop benchmark, only the real-model one, or the cloud engine's (benchmarks/cloud/engine.py)",
    )
    parser.add_argument("--hops-requests", type=int, default=400, help="interleaved requests per path in hops")
    args, rest = parser.parse_known_args(argv)
    if args.only == "cloud":  # its own options (see `meshserve bench --only cloud -h`)
        from benchmarks.cloud import engine as cloud

        given = ["--max-tokens", str(args.max_tokens)] if args.max_tokens else []
        return cloud.main([*rest, *given, "--out", str(args.out)])
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.only in (None, "hops"):
        from benchmarks.gateway import hops

        hop_report = asyncio.run(hops.run(args.hops_requests, max(100, args.hops_requests * 3 // 4)))
        hops.write_report(hop_report, args.out)
        print(hops.markdown(hop_report))
    if args.only in (None, "model"):
        report = asyncio.run(run(args.requests, args.max_tokens or 64))
        write_report(report, args.out)
        print(_markdown(report))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
