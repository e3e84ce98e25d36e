"""``meshserve bench batch``: does a running batch leave interactive traffic alone?

One run of the real mesh (``Mesh``, ``meshserve up``'s topology: edge workers, the router inside the
gateway, one batch runner) and one steady open-loop interactive load (greedy Generate calls of
``--max-tokens`` tokens at ``--rate`` requests/s, distinct prompts, the response cache bypassed):

1. ``baseline``: the interactive load alone for ``--seconds``;
2. ``with batch``: a batch of ``--lines`` completions is submitted (gRPC Batches, the same calls as
   ``/v1/batches``) and the same interactive load runs for ``--seconds`` while the batch runs;
3. the batch is then left to finish (its time is reported; the target needs it to finish).

Reports the interactive TTFT (first token frame at the client) p50/p99 of both phases and
``TARGET batch_interactive_ttft_p99_rise: <p99 with / p99 baseline - 1> (target <= 0.10): PASS|FAIL``;
``--out`` writes the markdown report (docs/benchmarks/batch.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from benchmarks.stats import percentile
from services.common.pb.meshserve.v1 import batch_pb2 as bpb
from services.common.pb.meshserve.v1 import batch_pb2_grpc, inference_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.local.mesh import DEV_API_KEY, Mesh, MeshConfig

AUTH = (("authorization", f"Bearer {DEV_API_KEY}"),)
TARGET = 0.10


def _quiet(name: str, line: str) -> None:
    if '"level": "error"' in line or "Traceback" in line:
        print(f"{name} | {line}")


async def _one(
    stub: inference_pb2_grpc.InferenceStub, prompt: str, max_tokens: int, out: list[float], errors: list[str]
) -> None:
    # The default priority (0), as a client that sets none: the batch's lines share its class, so what
    # keeps them out of the way here is the runner's free-capacity throttle alone.
    request = pb.GenerateRequest(
        prompt=prompt,
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0),
        routing=pb.RoutingOptions(cache_policy=pb.CACHE_POLICY_BYPASS),
    )
    start = time.perf_counter()
    try:
        # The first frame, whatever it holds: a turn whose first token is the end still has a TTFT.
        async for _frame in stub.Generate(request, metadata=AUTH, timeout=120):
            out.append(time.perf_counter() - start)
            break
    except grpc.aio.AioRpcError as exc:
        errors.append(exc.code().name)


async def interactive(
    stub: inference_pb2_grpc.InferenceStub, tag: str, rate: float, seconds: float, max_tokens: int
) -> tuple[list[float], list[str]]:
    """An open-loop load: one request every 1/rate s for ``seconds``; returns the TTFTs and errors."""
    ttfts: list[float] = []
    errors: list[str] = []
    tasks = []
    t0 = time.monotonic()
    i = 0
    while time.monotonic() - t0 < seconds:
        prompt = f"Story {tag}-{i}. Once upon a time, a {('red', 'yellow', 'green', 'orange')[i % 4]} fox walked into"
        tasks.append(asyncio.create_task(_one(stub, prompt, max_tokens, ttfts, errors)))
        i += 1
        await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
    await asyncio.gather(*tasks)
    return ttfts, errors


def _batch_file(lines: int, max_tokens: int) -> bytes:
    rows = [
        {
            "custom_id": f"b{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "prompt": f"Item {i}. The sea was calm that morning, and the old fisherman",
                "max_tokens": max_tokens,
                "temperature": 0,
            },
        }
        for i in range(lines)
    ]
    return "\n".join(json.dumps(r) for r in rows).encode()


async def run(args: argparse.Namespace) -> dict[str, object]:
    env = {"MESHSERVE_BATCH_MAX_IN_FLIGHT": str(args.runner_max_in_flight)}
    config = MeshConfig(edge_workers=args.edge_workers, cloud_workers=0, batch_runners=1, envoy=False, extra_env=env)
    async with Mesh(config, sink=_quiet) as mesh, grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        batches = batch_pb2_grpc.BatchesStub(channel)
        await interactive(stub, "warm", args.rate, 5, args.max_tokens)  # warm-up, not counted
        base, base_err = await interactive(stub, "a", args.rate, args.seconds, args.max_tokens)
        upload = await batches.CreateFile(
            bpb.CreateFileRequest(
                filename="bench.jsonl", purpose="batch", content=_batch_file(args.lines, args.batch_max_tokens)
            ),
            metadata=AUTH,
        )
        submitted = time.monotonic()
        batch = await batches.CreateBatch(
            bpb.CreateBatchRequest(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"),
            metadata=AUTH,
        )
        loaded, loaded_err = await interactive(stub, "b", args.rate, args.seconds, args.max_tokens)
        during = await batches.GetBatch(bpb.BatchRef(batch_id=batch.id), metadata=AUTH)
        while True:
            state = await batches.GetBatch(bpb.BatchRef(batch_id=batch.id), metadata=AUTH)
            if state.status in ("completed", "failed", "expired", "cancelled"):
                break
            if time.monotonic() - submitted > args.batch_timeout_s:
                break
            await asyncio.sleep(1.0)
        batch_s = time.monotonic() - submitted
    p99_base, p99_loaded = percentile(base, 99), percentile(loaded, 99)
    rise = p99_loaded / p99_base - 1
    return {
        "rate_rps": args.rate,
        "seconds_per_phase": args.seconds,
        "interactive_max_tokens": args.max_tokens,
        "edge_workers": args.edge_workers,
        "batch_lines": args.lines,
        "batch_max_tokens": args.batch_max_tokens,
        "runner_max_in_flight": args.runner_max_in_flight,
        "baseline": {
            "n": len(base),
            "errors": len(base_err),
            "p50_ms": statistics.median(base) * 1000,
            "p99_ms": p99_base * 1000,
        },
        "with_batch": {
            "n": len(loaded),
            "errors": len(loaded_err),
            "p50_ms": statistics.median(loaded) * 1000,
            "p99_ms": p99_loaded * 1000,
        },
        "batch_lines_done_during_phase": during.request_counts.completed + during.request_counts.failed,
        "batch_status": state.status,
        "batch_completed": state.request_counts.completed,
        "batch_failed": state.request_counts.failed,
        "batch_seconds": batch_s,
        "rise": rise,
        "host": f"{platform.machine()}, {platform.python_version()}",
    }


def target_line(rise: float, finished: bool) -> str:
    ok = rise <= TARGET and finished
    return f"TARGET batch_interactive_ttft_p99_rise: {rise:.3f} (target <= {TARGET:.2f}): {'PASS' if ok else 'FAIL'}"


def report(r: dict[str, object], command: str) -> str:
    b, w = r["baseline"], r["with_batch"]
    assert isinstance(b, dict) and isinstance(w, dict)
    finished = r["batch_status"] == "completed"
    return "\n".join(
        [
            "# Batch lines vs interactive TTFT",
            "",
            f"Command: `{command}` (one run; host: {r['host']}, the shared 2-core machine).",
            "",
            f"Interactive load: {r['rate_rps']} Generate/s open loop, {r['interactive_max_tokens']} tokens each, "
            f"{r['seconds_per_phase']} s per phase; {r['edge_workers']} edge workers, router in the gateway,"
            " one batch runner.",
            f"Batch: {r['batch_lines']} completions of {r['batch_max_tokens']} tokens; runner MAX_IN_FLIGHT "
            f"{r['runner_max_in_flight']}, RESERVE_SLOTS 1 (default).",
            "",
            "| phase | requests | errors | TTFT p50 ms | TTFT p99 ms |",
            "|---|---|---|---|---|",
            f"| interactive alone | {b['n']} | {b['errors']} | {b['p50_ms']:.1f} | {b['p99_ms']:.1f} |",
            f"| interactive + batch running | {w['n']} | {w['errors']} | {w['p50_ms']:.1f} | {w['p99_ms']:.1f} |",
            "",
            f"Batch lines finished during the loaded phase: {r['batch_lines_done_during_phase']}; the batch ended "
            f"`{r['batch_status']}` ({r['batch_completed']} completed, {r['batch_failed']} failed) "
            f"{float(r['batch_seconds']):.0f} s after submission.",  # type: ignore[arg-type]
            "",
            "```",
            target_line(float(r["rise"]), finished),  # type: ignore[arg-type]
            "```",
            "",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshserve bench batch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=2.0, help="interactive requests per second (default 2)")
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each phase (default 60)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per interactive request (default 16)")
    parser.add_argument("--lines", type=int, default=2000, help="batch lines (default 2000, the issue's size)")
    parser.add_argument("--batch-max-tokens", type=int, default=16, help="tokens per batch line (default 16)")
    parser.add_argument("--edge-workers", type=int, default=2)
    parser.add_argument(
        "--runner-max-in-flight", type=int, default=4, help="the runner's MAX_IN_FLIGHT (default 4, its default)"
    )
    parser.add_argument("--batch-timeout-s", type=float, default=1800.0, help="stop waiting for the batch after this")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown report here")
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    text = report(result, " ".join(["meshserve bench batch", *(argv or [])]))
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
