"""``meshserve bench batch``: does a running batch leave interactive traffic alone?

One run of the real mesh (``Mesh``, ``meshserve up``'s topology: edge workers, the router inside the
gateway, one batch runner) and one steady open-loop interactive load (greedy Generate calls of
``--max-tokens`` tokens at ``--rate`` requests/s, distinct prompts, the response cache bypassed).
A batch of ``--lines`` completions is submitted at the start (gRPC Batches, the same calls as
``/v1/batches``), then the two phases alternate for ``--rounds`` rounds, each phase ``--seconds``
in all (``--seconds / --rounds`` per slice), so that the host's own drift (other work on a shared
machine) falls on both alike:

* ``baseline``: the batch runner is paused (SIGSTOP) and the lines it had running have ended
  (``--settle-s``): the interactive load alone;
* ``with batch``: the runner runs (SIGCONT) and the same load goes on while it takes lines.

The batch is then left to finish (its time is reported; the target needs it to finish). Reports the
interactive TTFT (first frame at the client) p50/p99 of each phase pooled over the rounds, and per
slice, the host's load average, and
``TARGET batch_interactive_ttft_p99_rise: <p99 with / p99 baseline - 1> (target <= 0.10): PASS|FAIL``;
``--out`` writes the markdown report (``--append``: adds this run to it), ``--json`` the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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


def _signal(proc: asyncio.subprocess.Process | None, sig: signal.Signals) -> None:
    if proc is not None and proc.returncode is None:
        os.kill(proc.pid, sig)


def _hold_counters(urls: dict[str, str]) -> dict[str, float]:
    """The edge workers' ``meshserve_background_*`` counters (services/edge_worker/hold.py), summed over
    the workers, by series (labels kept); {} when none answers. Blocking: call in a thread."""
    found: dict[str, float] = {}
    for name, url in urls.items():
        if not name.startswith("edge"):
            continue
        try:
            with urllib.request.urlopen(url, timeout=5) as page:
                text = page.read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("meshserve_background_") and "_created" not in line:
                series, _, value = line.rpartition(" ")
                found[series] = found.get(series, 0.0) + float(value)
    return found


def _phase(ttfts: list[float], errors: list[str]) -> dict[str, float | int]:
    return {
        "n": len(ttfts),
        "errors": len(errors),
        "p50_ms": statistics.median(ttfts) * 1000 if ttfts else float("nan"),
        "p99_ms": percentile(ttfts, 99) * 1000,
    }


async def run(args: argparse.Namespace) -> dict[str, object]:
    env = {"MESHSERVE_BATCH_MAX_IN_FLIGHT": str(args.runner_max_in_flight)}
    if args.slots_only:
        env["MESHSERVE_BATCH_HEADROOM"] = "false"
    for setting in args.runner_env:
        name, _, value = setting.partition("=")
        env[f"MESHSERVE_BATCH_{name.upper()}"] = value
    config = MeshConfig(edge_workers=args.edge_workers, cloud_workers=0, batch_runners=1, envoy=False, extra_env=env)
    load_before = os.getloadavg()
    async with Mesh(config, sink=_quiet) as mesh, grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        batches = batch_pb2_grpc.BatchesStub(channel)
        runner = mesh.processes["batch"].proc
        await interactive(stub, "warm", args.rate, 5, args.max_tokens)  # warm-up, not counted
        _signal(runner, signal.SIGSTOP)  # paused until the first loaded slice
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
        base: list[float] = []
        base_err: list[str] = []
        loaded: list[float] = []
        loaded_err: list[str] = []
        rounds: list[dict[str, object]] = []
        done_in_loaded = 0
        slice_s = args.seconds / args.rounds
        try:
            for r in range(args.rounds):
                _signal(runner, signal.SIGSTOP)
                await asyncio.sleep(args.settle_s)  # the lines it had running end
                a, a_err = await interactive(stub, f"a{r}", args.rate, slice_s, args.max_tokens)
                before = await batches.GetBatch(bpb.BatchRef(batch_id=batch.id), metadata=AUTH)
                if not args.control:
                    _signal(runner, signal.SIGCONT)
                b, b_err = await interactive(stub, f"b{r}", args.rate, slice_s, args.max_tokens)
                after = await batches.GetBatch(bpb.BatchRef(batch_id=batch.id), metadata=AUTH)
                lines_done = sum(
                    (x.request_counts.completed + x.request_counts.failed) * sign
                    for x, sign in ((after, 1), (before, -1))
                )
                done_in_loaded += lines_done
                rounds.append(
                    {"baseline": _phase(a, a_err), "with_batch": _phase(b, b_err), "batch_lines_done": lines_done}
                )
                base += a
                base_err += a_err
                loaded += b
                loaded_err += b_err
                print(
                    f"round {r + 1}/{args.rounds}: baseline p50/p99 {rounds[-1]['baseline']['p50_ms']:.0f}/"  # type: ignore[index]
                    f"{rounds[-1]['baseline']['p99_ms']:.0f} ms, with batch "  # type: ignore[index]
                    f"{rounds[-1]['with_batch']['p50_ms']:.0f}/{rounds[-1]['with_batch']['p99_ms']:.0f} ms, "  # type: ignore[index]
                    f"{lines_done} lines, load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
        finally:
            _signal(runner, signal.SIGCONT)
        load_phases = os.getloadavg()
        holds = await asyncio.to_thread(_hold_counters, mesh.metrics_urls())
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
        "rounds": args.rounds,
        "interactive_max_tokens": args.max_tokens,
        "edge_workers": args.edge_workers,
        "batch_lines": args.lines,
        "batch_max_tokens": args.batch_max_tokens,
        "runner_max_in_flight": args.runner_max_in_flight,
        "admission": "slots" if args.slots_only else "headroom",
        "control": args.control,
        "runner_env": list(args.runner_env),
        "baseline": _phase(base, base_err),
        "with_batch": _phase(loaded, loaded_err),
        "per_round": rounds,
        "batch_lines_done_during_phase": done_in_loaded,
        "batch_status": state.status,
        "batch_completed": state.request_counts.completed,
        "batch_failed": state.request_counts.failed,
        "batch_seconds": batch_s,
        "rise": rise,
        "hold_counters_after_phases": holds,
        "p50_rise": statistics.median(loaded) / statistics.median(base) - 1,
        "load_average": {"before": load_before[0], "after_phases": load_phases[0], "end": os.getloadavg()[0]},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": f"{platform.machine()}, {platform.python_version()}",
    }


def target_line(rise: float, finished: bool) -> str:
    ok = rise <= TARGET and finished
    return f"TARGET batch_interactive_ttft_p99_rise: {rise:.3f} (target <= {TARGET:.2f}): {'PASS' if ok else 'FAIL'}"


HEADER = """# Batch lines vs interactive TTFT (issue 28)

`meshserve bench batch` (benchmarks/batch/priority.py): one mesh (`meshserve up`'s topology, edge
tier only: 2 edge workers, the router in the gateway, one batch runner), one steady open-loop
interactive load (greedy Generate, distinct prompts, response cache bypassed, default priority: the
batch's own class, so the runner's admission alone protects it). A batch is submitted at the start;
then the phases alternate for a few rounds: *baseline* (the runner paused with SIGSTOP, the lines it
had running ended) and *with batch* (the runner running). TTFT is the first frame at the client,
pooled per phase over the rounds. The target: the interactive TTFT p99 rises by at most 10 % while
the batch runs, and the batch finishes. How admission works and what these runs say:
[docs/batch.md](../batch.md).
"""


def report(r: dict[str, object], command: str) -> str:
    """This run's section of the page."""
    b, w, load = r["baseline"], r["with_batch"], r["load_average"]
    assert isinstance(b, dict) and isinstance(w, dict) and isinstance(load, dict)
    finished = r["batch_status"] == "completed"
    per_round: list[dict[str, Any]] = r["per_round"]  # type: ignore[assignment]
    rows = [
        f"| {i + 1} | {x['baseline']['n']} | {x['baseline']['p50_ms']:.0f} | {x['baseline']['p99_ms']:.0f} | "
        f"{x['with_batch']['n']} | {x['with_batch']['p50_ms']:.0f} | {x['with_batch']['p99_ms']:.0f} | "
        f"{x['batch_lines_done']} |"
        for i, x in enumerate(per_round)
    ]
    return "\n".join(
        [
            f"## {r['date']}: {r['batch_lines']} lines, admission by {r['admission']}"
            + (", CONTROL: the runner paused in both phases (the method's noise)" if r.get("control") else ""),
            "",
            f"Command: `{command}` (host: {r['host']}, the shared 2-core machine; load average "
            f"{load['before']:.2f} before, {load['after_phases']:.2f} after the phases, {load['end']:.2f} at the end).",
            "",
            f"Interactive load: {r['rate_rps']} Generate/s open loop, {r['interactive_max_tokens']} tokens each, "
            f"{r['seconds_per_phase']} s per phase in {r['rounds']} rounds; {r['edge_workers']} edge workers, "
            "router in the gateway, one batch runner.",
            f"Batch: {r['batch_lines']} completions of {r['batch_max_tokens']} tokens; runner MAX_IN_FLIGHT "
            f"{r['runner_max_in_flight']}, RESERVE_SLOTS 1, admission by {r['admission']}"
            f"{''.join(', ' + s for s in r.get('runner_env', []))}.",  # type: ignore[attr-defined]
            "",
            "| phase | requests | errors | TTFT p50 ms | TTFT p99 ms |",
            "|---|---|---|---|---|",
            f"| interactive alone | {b['n']} | {b['errors']} | {b['p50_ms']:.1f} | {b['p99_ms']:.1f} |",
            f"| interactive + batch running | {w['n']} | {w['errors']} | {w['p50_ms']:.1f} | {w['p99_ms']:.1f} |",
            "",
            "| round | alone n | p50 | p99 | with batch n | p50 | p99 | lines done |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"p50 rise {float(r['p50_rise']):+.3f}. Batch lines finished during the loaded slices: "  # type: ignore[arg-type]
            f"{r['batch_lines_done_during_phase']}; the batch ended `{r['batch_status']}` ({r['batch_completed']} "
            f"completed, {r['batch_failed']} failed) {float(r['batch_seconds']):.0f} s after submission.",  # type: ignore[arg-type]
            "",
            "Background hold counters of the edge workers after the phases (docs/edge.md, *Background "
            "sequences yield*): "
            + (
                ", ".join(f"`{k}` {v:g}" for k, v in sorted(r.get("hold_counters_after_phases", {}).items()))  # type: ignore[attr-defined]
                or "none read"
            )
            + ".",
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
    parser.add_argument("--seconds", type=float, default=120.0, help="length of each phase in all (default 120)")
    parser.add_argument("--rounds", type=int, default=6, help="baseline/with-batch alternations (default 6)")
    parser.add_argument(
        "--settle-s", type=float, default=3.0, help="pause after the runner stops before a baseline slice"
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per interactive request (default 16)")
    parser.add_argument("--lines", type=int, default=2000, help="batch lines (default 2000, the issue's size)")
    parser.add_argument("--batch-max-tokens", type=int, default=16, help="tokens per batch line (default 16)")
    parser.add_argument("--edge-workers", type=int, default=2)
    parser.add_argument(
        "--runner-max-in-flight", type=int, default=4, help="the runner's MAX_IN_FLIGHT (default 4, its default)"
    )
    parser.add_argument(
        "--slots-only", action="store_true", help="the runner's admission by free slots alone (HEADROOM=false)"
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="keep the runner paused in the 'with batch' slices too: the rise the method shows with no batch at all",
    )
    parser.add_argument(
        "--runner-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="another runner setting, e.g. HEADROOM_MAX_DEFER_S=60 (MESHSERVE_BATCH_ is added; repeatable)",
    )
    parser.add_argument("--batch-timeout-s", type=float, default=1800.0, help="stop waiting for the batch after this")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown report here")
    parser.add_argument("--append", action="store_true", help="add this run to --out instead of replacing it")
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    result["command"] = " ".join(["meshserve bench batch", *(argv or [])])
    text = report(result, str(result["command"]))
    print(text)
    if args.out is not None:
        if args.append and args.out.exists():
            with args.out.open("a") as page:
                page.write("\n" + text)
        else:
            args.out.write_text(HEADER + "\n" + text)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
