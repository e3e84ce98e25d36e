"""``meshserve bench tiers-ab --ab-tree TREE``: both tiers' real workers, this tree's vs TREE's, in one
run (issue 37's two no-regression targets).

**Edge** (issue 27's benchmark, both trees in the same run): each tree's edge worker as a real process
of that tree (``python -P -m services.edge_worker``, ``PYTHONPATH`` = the tree; ``--threads``,
``--engine``, the worker's defaults otherwise) behind that tree's gateway with the router embedded
(benchmarks/gateway/tree_mesh.py). ``--rounds`` rounds; in each, the two trees in alternating order,
and for each tree: its lone stream, onnxruntime-genai's lone stream right after it (in this process,
``og.Generator``), its ``--streams`` streams at once, llama.cpp's run right after it (Q4_0 of the
same GGUF, ``llama-batched-bench``; benchmarks/edge/llamacpp.py). Requests and timing are
benchmarks/edge/mesh.py's: greedy, the EDGE hint, response cache bypassed; lone stream = decode tok/s
of the stream, N streams = generated tokens / wall time of the round. Each tree's ratio is the median
of its rounds over the median of the reference runs that followed them.

**Cloud** (on CPU): each tree's cloud worker as a real process of that tree (``python -P -m
services.gpu_worker``, ``MESHSERVE_GPU_WORKER_DEVICE=cpu``, ``MAX_ACTIVE_SEQUENCES`` =
``--cloud-max-active``, the worker's defaults otherwise), driven directly over the worker's gRPC
``Generate`` (benchmarks/load/senders.py's ``worker_sender``: no gateway, no router): greedy, closed
loop at 16 and 64 streams, a fixed prompt set per round (the same for both trees; ``streams x
--cloud-requests-per-stream`` requests), interleaved rounds in alternating order; tok/s = generated
tokens / wall time of the round.

Writes ``tiers_ab.{json,md}`` under ``--out`` and prints TARGET lines: new / old of each edge ratio
(>= 1.0), the new tree's absolute issue-27 ratios (>= 1.0x onnxruntime-genai, >= 1.25x llama.cpp),
and the cloud tier's new / old tok/s at 16 and 64 streams (>= 1.0).
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
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from benchmarks.report import target_line

SIDES = ("new", "old")
EDGE_LONE_VS_ORTGENAI = 1.0  # issue 27
EDGE_TOP_VS_LLAMACPP = 1.25  # issue 27
NEW_VS_OLD = 1.0  # issue 37: no regression
EDGE_WORKER = ["-P", "-m", "services.edge_worker"]
CLOUD_WORKER = ["-P", "-m", "services.gpu_worker"]
KERNEL_PROBE = (
    "from services.common.config import load_settings\n"
    "from services.edge_worker.config import EdgeWorkerSettings\n"
    "from services.edge_worker.server import int4_kernel\n"
    "print('int4_kernel=' + int4_kernel(load_settings(EdgeWorkerSettings)))\n"
)


def side_order(round_index: int) -> tuple[str, str]:
    """The trees' order in round ``round_index`` (from 0): new first in even rounds, old first in odd."""
    return ("new", "old") if round_index % 2 == 0 else ("old", "new")


class LogTail:
    """A log sink for the services: the last lines of each process (shown when one fails to start) and
    every int4 kernel fallback an edge worker logs."""

    def __init__(self, keep: int = 40) -> None:
        self.lines: dict[str, deque[str]] = {}
        self.keep = keep
        self.kernel_fallbacks: list[str] = []

    def __call__(self, name: str, line: str) -> None:
        self.lines.setdefault(name, deque(maxlen=self.keep)).append(line)
        if "edge_int4_kernel_fallback" in line:
            self.kernel_fallbacks.append(f"{name}: {line}")

    def dump(self) -> str:
        return "\n".join(f"[{name}] {line}" for name, lines in self.lines.items() for line in lines)


def edge_worker_settings(side: str, threads: int, engine: str, streams: int) -> dict[str, str]:
    """The edge worker's environment (issue 27's runs: threads, engine, slots for ``streams``)."""
    return {
        "MESHSERVE_EDGE_WORKER_WORKER_ID": f"edge-{side}",
        "MESHSERVE_EDGE_WORKER_THREADS": str(threads),
        "MESHSERVE_EDGE_WORKER_ENGINE": engine,
        "MESHSERVE_EDGE_WORKER_MAX_ACTIVE_SEQUENCES": str(streams),
        "MESHSERVE_EDGE_WORKER_MAX_QUEUE": str(2 * streams),
    }


def cloud_worker_settings(side: str, max_active: int) -> dict[str, str]:
    return {
        "MESHSERVE_GPU_WORKER_WORKER_ID": f"cloud-{side}",
        "MESHSERVE_GPU_WORKER_DEVICE": "cpu",
        "MESHSERVE_GPU_WORKER_MAX_ACTIVE_SEQUENCES": str(max_active),
    }


def resolved_int4_kernel(tree: Path, settings: dict[str, str]) -> str:
    """The int4 kernel ``tree``'s edge worker runs with ``settings``: ``auto`` resolved by that tree's own
    rule (services/edge_worker/server.py's ``int4_kernel``), in a process of that tree."""
    env = {**os.environ, **settings, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-P", "-c", KERNEL_PROBE], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    found = [line.split("=", 1)[1] for line in done.stdout.splitlines() if line.startswith("int4_kernel=")]
    if done.returncode != 0 or not found:
        return f"unknown (the probe failed: {(done.stderr or done.stdout).strip()[-300:]})"
    return found[-1]


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def llamacpp_top(sample: dict[str, Any], streams: int) -> float | None:
    """llama.cpp's aggregate tok/s at ``streams`` in one of its runs (None: not measured)."""
    run = sample.get("llamacpp")
    if not run:
        return None
    return next((r["aggregate_tokens_per_s"] for r in run["rounds"] if r["streams"] == streams), None)


def edge_summary(samples: list[dict[str, Any]], streams: int) -> dict[str, dict[str, Any]]:
    """Per tree: medians of its rounds (lone-stream decode tok/s, ``streams``-stream aggregate tok/s,
    worker CPU per token), of the reference runs right after them, and the ratios of those medians."""
    out: dict[str, dict[str, Any]] = {}
    for side in SIDES:
        mine = [s for s in samples if s["side"] == side]
        if not mine:
            continue
        llama = [v for v in (llamacpp_top(s, streams) for s in mine) if v is not None]
        got: dict[str, Any] = {
            "rounds": len(mine),
            "lone_tokens_per_s": _median([s["lone"]["decode_tokens_per_s"] for s in mine]),
            "lone_worker_cpu_ms_per_token": _median([s["lone"]["worker_cpu_ms_per_token"] for s in mine]),
            "ortgenai_tokens_per_s": _median([s["ortgenai"]["decode_tokens_per_s"] for s in mine if s.get("ortgenai")]),
            "top_tokens_per_s": _median([s["top"]["aggregate_tokens_per_s"] for s in mine]),
            "top_worker_cpu_ms_per_token": _median([s["top"]["worker_cpu_ms_per_token"] for s in mine]),
            "llamacpp_tokens_per_s": _median(llama),
        }
        got["lone_vs_ortgenai"] = _ratio(got["lone_tokens_per_s"], got["ortgenai_tokens_per_s"])
        got["top_vs_llamacpp"] = _ratio(got["top_tokens_per_s"], got["llamacpp_tokens_per_s"])
        # Each round's own ratio (its run over the reference run right after it), median over the rounds:
        # less exposed to a reference that ran fast after one tree and slow after the other.
        got["lone_vs_ortgenai_per_round"] = _median(
            [
                r
                for s in mine
                if s.get("ortgenai")
                and (r := _ratio(s["lone"]["decode_tokens_per_s"], s["ortgenai"]["decode_tokens_per_s"])) is not None
            ]
        )
        got["top_vs_llamacpp_per_round"] = _median(
            [r for s in mine if (r := _ratio(s["top"]["aggregate_tokens_per_s"], llamacpp_top(s, streams))) is not None]
        )
        out[side] = got
    return out


def cloud_summary(samples: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per stream count (``str`` keys, ascending): each tree's median tok/s and worker CPU per token over
    its rounds, failed requests summed, and new / old of the medians."""
    out: dict[str, dict[str, Any]] = {}
    for streams in sorted({s["streams"] for s in samples}):
        got: dict[str, Any] = {}
        for side in SIDES:
            mine = [s for s in samples if s["streams"] == streams and s["side"] == side]
            if mine:
                got[side] = {
                    "rounds": len(mine),
                    "tokens_per_s": statistics.median(s["tokens_per_s"] for s in mine),
                    "worker_cpu_ms_per_token": statistics.median(s["worker_cpu_ms_per_token"] for s in mine),
                    "failed_requests": sum(s["requests"] - s["ok"] for s in mine),
                }
        if "new" in got and "old" in got:
            got["new_vs_old"] = _ratio(got["new"]["tokens_per_s"], got["old"]["tokens_per_s"])
        out[str(streams)] = got
    return out


def _row(name: str, value: float | None, bound: float, detail: str, skipped: str | None = None) -> dict[str, Any]:
    """One target: its value (rounded as printed; judged on that) or why it is skipped."""
    if value is None:
        return {"name": name, "skipped": skipped or "not measured", "detail": detail}
    shown = round(value, 3)
    target = f">= {bound}x"
    return {
        "name": name,
        "value": shown,
        "unit": "x",
        "format": ".3f",
        "bound": target,
        "pass": shown >= bound,
        "detail": detail,
    }


def _num(value: float | None, spec: str = ".1f") -> str:
    return "n/a" if value is None else format(value, spec)


def _times(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}x"


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The TARGET rows of what was measured: edge new / old and the new tree's issue-27 ratios, then
    the cloud tier's new / old per stream count."""
    rows: list[dict[str, Any]] = []
    edge = report.get("edge")
    if edge is not None:
        new, old = edge["summary"].get("new", {}), edge["summary"].get("old", {})
        top = edge["streams"]
        llama_skipped = edge["llamacpp"].get("skipped")

        def pair(key: str, value: str, ref: str) -> str:
            return (
                f"new {_times(new.get(key))} = {_num(new.get(value))} / {_num(new.get(ref))} tok/s; "
                f"old {_times(old.get(key))} = {_num(old.get(value))} / {_num(old.get(ref))} tok/s"
            )

        lone = pair("lone_vs_ortgenai", "lone_tokens_per_s", "ortgenai_tokens_per_s")
        many = pair("top_vs_llamacpp", "top_tokens_per_s", "llamacpp_tokens_per_s")
        rows += [
            _row(
                "edge_lone_stream_vs_ortgenai_new_vs_old",
                _ratio(new.get("lone_vs_ortgenai"), old.get("lone_vs_ortgenai")),
                NEW_VS_OLD,
                f"lone-stream decode / onnxruntime-genai's: {lone}",
            ),
            _row(
                f"edge_{top}_streams_vs_llamacpp_new_vs_old",
                _ratio(new.get("top_vs_llamacpp"), old.get("top_vs_llamacpp")),
                NEW_VS_OLD,
                f"{top} streams / llama.cpp's: {many}",
                llama_skipped,
            ),
            _row(
                "edge_single_stream_vs_ortgenai",
                new.get("lone_vs_ortgenai"),
                EDGE_LONE_VS_ORTGENAI,
                f"the new tree (issue 27's target); the old tree {_times(old.get('lone_vs_ortgenai'))}",
            ),
            _row(
                f"edge_{top}_streams_vs_llamacpp",
                new.get("top_vs_llamacpp"),
                EDGE_TOP_VS_LLAMACPP,
                f"the new tree (issue 27's target); the old tree {_times(old.get('top_vs_llamacpp'))}",
                llama_skipped,
            ),
        ]
    cloud = report.get("cloud")
    if cloud is not None:
        for streams, got in cloud["summary"].items():
            a, b = got.get("new", {}), got.get("old", {})
            failed = a.get("failed_requests", 0) + b.get("failed_requests", 0)
            detail = f"new {_num(a.get('tokens_per_s'))} vs old {_num(b.get('tokens_per_s'))} tok/s"
            detail += f"; {failed} requests FAILED" if failed else ""
            rows.append(_row(f"cloud_{streams}_streams_new_vs_old", got.get("new_vs_old"), NEW_VS_OLD, detail))
    return rows


def busy_warning(machine: dict[str, Any]) -> str | None:
    """A warning when the load average at the start or end was over half the CPUs."""
    cpus = machine.get("cpus") or 1
    load = max(machine.get("load_avg_1m_start", 0.0), machine.get("load_avg_1m_end", 0.0))
    if load <= 0.5 * cpus:
        return None
    return (
        f"WARNING: load average up to {load:.1f} on {cpus} CPUs: other jobs shared the CPU, so the wall-clock "
        "ratios are noisy; re-run on a quiet machine"
    )


def output_lines(report: dict[str, Any]) -> list[str]:
    """What is printed: the busy warning (if any), then each TARGET line with its detail."""
    warning = busy_warning(report["machine"])
    lines = [warning] if warning else []
    for row in report["targets"]:
        lines += [target_line(row), f"  ({row['detail']})"]
    return lines


def _edge_markdown(edge: dict[str, Any]) -> list[str]:
    top = edge["streams"]
    s = edge["summary"]
    lines = [
        "",
        f"## Edge tier: lone stream and {top} streams through each tree's mesh",
        "",
        f"Each tree's edge worker process ({edge['engine']} engine, {edge['threads']} threads, int4 kernel: "
        + ", ".join(f"{side} {edge['int4_kernel'][side]}" for side in SIDES)
        + f", the worker's defaults otherwise) behind its gateway with the router embedded; {edge['max_tokens']} "
        f"tokens per request; {edge['rounds']} rounds, the trees in alternating order, each tree's run followed "
        "at once by the reference's. Medians of the rounds:",
        "",
        f"| tree | lone tok/s | onnxruntime-genai tok/s | lone / og | {top} streams tok/s | llama.cpp tok/s | "
        f"{top} / llama.cpp | worker CPU ms/token (1 / {top}) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for side in SIDES:
        g = s.get(side)
        if g is None:
            continue
        lines.append(
            f"| {side} | {_num(g['lone_tokens_per_s'])} | {_num(g['ortgenai_tokens_per_s'])} | "
            f"{_times(g['lone_vs_ortgenai'])} | {_num(g['top_tokens_per_s'])} | "
            f"{_num(g['llamacpp_tokens_per_s'])} | {_times(g['top_vs_llamacpp'])} | "
            f"{_num(g['lone_worker_cpu_ms_per_token'])} / {_num(g['top_worker_cpu_ms_per_token'])} |"
        )
    new, old = s.get("new", {}), s.get("old", {})
    og_all = _median([x["ortgenai"]["decode_tokens_per_s"] for x in edge["samples"] if x.get("ortgenai")])
    llama_all = _median([v for v in (llamacpp_top(x, top) for x in edge["samples"]) if v is not None])
    lines += [
        "",
        f"Without the references: new / old lone stream "
        f"{_times(_ratio(new.get('lone_tokens_per_s'), old.get('lone_tokens_per_s')))}, {top} streams "
        f"{_times(_ratio(new.get('top_tokens_per_s'), old.get('top_tokens_per_s')))}. The references over all "
        f"their runs: onnxruntime-genai {_num(og_all)} tok/s, llama.cpp {_num(llama_all)} tok/s (medians). "
        f"Each round's own ratio, median over the rounds: lone / og new "
        f"{_times(new.get('lone_vs_ortgenai_per_round'))}, old {_times(old.get('lone_vs_ortgenai_per_round'))}; "
        f"{top} / llama.cpp new {_times(new.get('top_vs_llamacpp_per_round'))}, old "
        f"{_times(old.get('top_vs_llamacpp_per_round'))}.",
    ]
    lines += ["", f"Round by round (tree: lone tok/s, og tok/s; {top} streams tok/s, llama.cpp tok/s):", ""]
    for sample in edge["samples"]:
        og = sample.get("ortgenai") or {}
        lines.append(
            f"- round {sample['round']} {sample['side']}: {sample['lone']['decode_tokens_per_s']:.1f}, "
            f"{_num(og.get('decode_tokens_per_s'))}; {sample['top']['aggregate_tokens_per_s']:.1f}, "
            f"{_num(llamacpp_top(sample, top))}"
        )
    llama = edge["llamacpp"]
    lines += [
        "",
        f"llama.cpp: SKIPPED ({llama['skipped']})" if "skipped" in llama else f"llama.cpp: `{llama['command']}`",
    ]
    lines += [f"\nint4 kernel fallback logged: {line}" for line in edge.get("kernel_fallbacks", [])]
    return lines


def _cloud_markdown(cloud: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "## Cloud tier on CPU: each tree's cloud worker, straight over its gRPC Generate",
        "",
        f"`python -P -m services.gpu_worker` of each tree (device cpu, {cloud['max_active']} active sequences, the "
        f"worker's defaults otherwise), greedy, {cloud['max_tokens']} tokens at most per request, closed loop of "
        f"streams x {cloud['requests_per_stream']} requests per round (the same prompts for both trees), "
        f"{cloud['rounds']} rounds, the trees in alternating order. Medians of the rounds:",
        "",
        "| streams | new tok/s | old tok/s | new / old | worker CPU ms/token (new / old) | failed requests |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for streams, got in cloud["summary"].items():
        a, b = got.get("new", {}), got.get("old", {})
        lines.append(
            f"| {streams} | {_num(a.get('tokens_per_s'))} | {_num(b.get('tokens_per_s'))} | "
            f"{_times(got.get('new_vs_old'))} | {_num(a.get('worker_cpu_ms_per_token'))} / "
            f"{_num(b.get('worker_cpu_ms_per_token'))} | "
            f"{a.get('failed_requests', 0) + b.get('failed_requests', 0)} |"
        )
    lines += ["", "Round by round (tok/s):", ""]
    for sample in cloud["samples"]:
        lines.append(
            f"- round {sample['round']}, {sample['streams']} streams, {sample['side']}: "
            f"{sample['tokens_per_s']:.1f} ({sample['tokens']} tokens in {sample['wall_s']:.1f} s)"
        )
    return lines


def markdown(report: dict[str, Any]) -> str:
    from benchmarks.gateway.tree_mesh import tree_text

    machine = report["machine"]
    trees = report["trees"]
    lines = [
        "# Both tiers' real workers, this tree vs the tree before the engine loop (issue 37)",
        "",
        f"{report['date']} · {machine['cpus']} CPUs · {machine['platform']} · 1-min load average "
        f"{machine['load_avg_1m_start']:.2f} at the start, {machine['load_avg_1m_end']:.2f} at the end · "
        f"`{report['command']}`",
        "",
        f"New: {tree_text(trees['new'])}; old: {tree_text(trees['old'])}."
        + (" Both ran the same services/ code (A/A)." if report.get("same_services") else ""),
    ]
    if report.get("edge") is not None:
        lines += _edge_markdown(report["edge"])
    if report.get("cloud") is not None:
        lines += _cloud_markdown(report["cloud"])
    lines += ["", "## Targets", "", "```", *output_lines(report), "```"]
    return "\n".join(lines) + "\n"


async def edge_ab(
    trees: dict[str, Path],
    *,
    threads: int,
    engine: str,
    max_tokens: int,
    streams: int,
    rounds: int,
    llama: Callable[[], dict[str, Any]] | str,
    start_timeout_s: float,
) -> dict[str, Any]:
    """The edge rounds (module docstring); ``llama``: one llama.cpp run (benchmarks.edge.mesh's
    ``llamacpp_runner``) or why it cannot run."""
    import grpc
    from tokenizers import Tokenizer

    from benchmarks.edge.mesh import PROMPT, mesh_round, mesh_stream, ortgenai_model, ortgenai_round
    from benchmarks.gateway.tree_mesh import TreeMesh, start_mesh
    from services.common.model_paths import model_paths
    from services.common.pb.meshserve.v1 import inference_pb2_grpc

    edge_dir = model_paths().edge_dir
    og_model = ortgenai_model(edge_dir, threads)
    og_prompt = list(Tokenizer.from_file(str(edge_dir / "tokenizer.json")).encode(PROMPT).ids)
    ortgenai_round(og_model, og_prompt, 4)  # warm-up
    settings = {side: edge_worker_settings(side, threads, engine, streams) for side in SIDES}
    kernels = {side: resolved_int4_kernel(trees[side], settings[side]) for side in SIDES}
    print(f"edge int4 kernel: {kernels}", file=sys.stderr, flush=True)
    logs = LogTail()
    tmp = tempfile.TemporaryDirectory(prefix="meshserve-tiers-ab-")
    meshes: dict[str, TreeMesh] = {}
    samples: list[dict[str, Any]] = []
    llama_skipped = llama if isinstance(llama, str) else None
    llama_command: dict[str, Any] = {}
    try:
        for side in SIDES:
            print(f"starting the {side} tree's edge mesh ...", file=sys.stderr, flush=True)
            try:
                meshes[side] = await start_mesh(
                    tmp.name,
                    trees[side],
                    layouts=("embedded",),
                    worker_settings=settings[side],
                    suffix=f"_{side}",
                    sink=logs,
                    timeout_s=start_timeout_s,
                    worker_argv=[sys.executable, *EDGE_WORKER],
                )
            except (RuntimeError, TimeoutError):
                print(logs.dump(), file=sys.stderr)
                raise
        async with AsyncExitStack() as stack:
            stubs, pids = {}, {}
            for side, mesh in meshes.items():
                address = mesh.procs[f"gateway_embedded_{side}"].address
                channel = await stack.enter_async_context(grpc.aio.insecure_channel(address))
                stubs[side] = inference_pb2_grpc.InferenceStub(channel)
                pids[side] = mesh.pids()[f"worker_{side}"]
                await mesh_stream(stubs[side], 4)  # warm the path
            for r in range(rounds):
                for position, side in enumerate(side_order(r)):
                    say = f"[edge] round {r + 1}/{rounds} {side}"
                    print(f"{say}: 1 stream, onnxruntime-genai, {streams} streams, llama.cpp ...", file=sys.stderr)
                    sample: dict[str, Any] = {"round": r + 1, "side": side, "position": position}
                    sample["lone"] = await mesh_round(stubs[side], 1, max_tokens, pids[side])
                    sample["ortgenai"] = ortgenai_round(og_model, og_prompt, max_tokens)  # right after: same load
                    sample["top"] = await mesh_round(stubs[side], streams, max_tokens, pids[side])
                    sample["llamacpp"] = None
                    if callable(llama) and llama_skipped is None:
                        try:
                            run = await asyncio.to_thread(llama)
                        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                            llama_skipped = f"llama.cpp run failed: {exc}"
                        else:
                            llama_command = {"model": run["model"], "command": run["command"]}
                            sample["llamacpp"] = {"rounds": run["rounds"]}
                    samples.append(sample)
                    print(
                        f"{say}: {sample['lone']['decode_tokens_per_s']:.1f} vs og "
                        f"{sample['ortgenai']['decode_tokens_per_s']:.1f}; "
                        f"{sample['top']['aggregate_tokens_per_s']:.1f} vs llama.cpp "
                        f"{_num(llamacpp_top(sample, streams))} tok/s",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        for mesh in meshes.values():
            await mesh.stop()
        tmp.cleanup()
    return {
        "engine": engine,
        "threads": threads,
        "max_tokens": max_tokens,
        "streams": streams,
        "rounds": rounds,
        "worker_settings": settings,
        "int4_kernel": kernels,
        "kernel_fallbacks": logs.kernel_fallbacks,
        "notes": [note for mesh in meshes.values() for note in mesh.notes],
        "llamacpp": {"skipped": llama_skipped} if llama_skipped is not None else llama_command,
        "samples": samples,
        "summary": edge_summary(samples, streams),
    }


async def cloud_ab(
    trees: dict[str, Path],
    *,
    streams: Sequence[int],
    max_tokens: int,
    requests_per_stream: int,
    rounds: int,
    max_active: int,
    start_timeout_s: float,
    request_timeout_s: float,
) -> dict[str, Any]:
    """The cloud rounds (module docstring)."""
    import grpc

    from benchmarks.gateway.hop_timing import cpu_ns
    from benchmarks.load.generator import Workload, closed_loop, make_items, summarize
    from benchmarks.load.senders import worker_sender
    from services.common.model_paths import model_paths
    from services.common.pb.meshserve.internal.v1 import worker_pb2_grpc
    from services.common.processes import ServiceProcess
    from services.common.tokenizer import Tokenizer

    logs = LogTail()
    workers: dict[str, ServiceProcess] = {}
    samples: list[dict[str, Any]] = []
    settings = {side: cloud_worker_settings(side, max_active) for side in SIDES}
    tokenizer = Tokenizer(model_paths().hf_dir)

    def items(tag: str, n: int, tokens: int) -> list[Any]:
        return make_items(Workload(max_tokens=tokens, tier="cloud"), n, random.Random(tag), tag=tag)

    async def one_round(side: str, batch: list[Any], concurrency: int) -> dict[str, Any]:
        proc = workers[side].proc
        assert proc is not None
        pid = proc.pid
        cpu = cpu_ns(pid)
        results, wall = await closed_loop(senders[side], batch, concurrency, float("inf"), timeout_s=request_timeout_s)
        got = summarize(results, wall)
        got["worker_cpu_ms_per_token"] = (cpu_ns(pid) - cpu) / 1e6 / max(1, got["tokens"])
        return got

    senders: dict[str, Any] = {}
    try:
        for side in SIDES:
            print(f"starting the {side} tree's cloud worker ...", file=sys.stderr, flush=True)
            env = {**os.environ, "PYTHONUNBUFFERED": "1", **settings[side], "PYTHONPATH": str(trees[side])}
            proc = ServiceProcess(f"cloud_{side}", [sys.executable, *CLOUD_WORKER], env, logs)
            workers[side] = proc
            try:
                await proc.spawn()
                await proc.wait_started(start_timeout_s)
                await proc.wait_serving(start_timeout_s)
            except (RuntimeError, TimeoutError):
                print(logs.dump(), file=sys.stderr)
                raise
        async with AsyncExitStack() as stack:
            for side, proc in workers.items():
                channel = await stack.enter_async_context(grpc.aio.insecure_channel(proc.address))
                stub = worker_pb2_grpc.WorkerStub(channel)
                senders[side] = worker_sender(stub, tokenizer.encode, timeout_s=request_timeout_s)
                warm = await one_round(side, items(f"warm-{side}-", max(streams), 4), max(streams))
                if warm["ok"] != warm["requests"]:
                    raise RuntimeError(f"the {side} tree's cloud worker failed warm-up requests: {warm['errors']}")
            for r in range(rounds):
                for n in streams:
                    batch = items(f"tiers-ab-{r}-{n}-", n * requests_per_stream, max_tokens)  # same for both
                    for position, side in enumerate(side_order(r)):
                        got = await one_round(side, batch, n)
                        got |= {"round": r + 1, "streams": n, "side": side, "position": position}
                        samples.append(got)
                        print(
                            f"[cloud] round {r + 1}/{rounds} {n} streams {side}: {got['tokens_per_s']:.1f} tok/s"
                            + (f" (errors {got['errors']})" if got["errors"] else ""),
                            file=sys.stderr,
                            flush=True,
                        )
    finally:
        for proc in workers.values():
            await proc.stop()
    return {
        "streams": list(streams),
        "max_tokens": max_tokens,
        "requests_per_stream": requests_per_stream,
        "rounds": rounds,
        "max_active": max_active,
        "worker_settings": settings,
        "transport": "the worker's gRPC Generate, directly (benchmarks/load/senders.py worker_sender)",
        "samples": samples,
        "summary": cloud_summary(samples),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshserve bench tiers-ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ab-tree", type=Path, required=True, help="the tree before the change (git worktree add)")
    parser.add_argument("--edge", action=argparse.BooleanOptionalAction, default=True, help="run the edge rounds")
    parser.add_argument("--cloud", action=argparse.BooleanOptionalAction, default=True, help="run the cloud rounds")
    parser.add_argument("--rounds", type=int, default=5, help="edge rounds (default 5)")
    parser.add_argument("--threads", type=int, default=2, help="edge worker intra-op threads (issue 27's runs: 2)")
    parser.add_argument("--engine", choices=("batched", "og"), default="batched", help="edge engine")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per edge request (default 48)")
    parser.add_argument("--streams", type=int, default=16, help="the edge's many-stream count (default 16)")
    parser.add_argument(
        "--llama-cpp-bin",
        type=Path,
        default=None,
        help="a llama.cpp build's bin directory (llama-batched-bench, llama-quantize); default: PATH",
    )
    parser.add_argument(
        "--llama-cpp-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "meshserve-llamacpp",
        help="where the Q4_0 GGUF for llama.cpp is written once",
    )
    parser.add_argument("--cloud-rounds", type=int, default=3, help="cloud rounds (default 3)")
    parser.add_argument("--cloud-streams", default="16,64", help="cloud stream counts (default 16,64)")
    parser.add_argument("--cloud-max-tokens", type=int, default=64, help="tokens per cloud request at most")
    parser.add_argument(
        "--cloud-requests-per-stream", type=int, default=2, help="requests per stream in each cloud round"
    )
    parser.add_argument(
        "--cloud-max-active", type=int, default=64, help="MESHSERVE_GPU_WORKER_MAX_ACTIVE_SEQUENCES (>= 64)"
    )
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds for a service to start")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds for one cloud request")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"), help="output directory")
    args = parser.parse_args(argv)
    from benchmarks.edge.mesh import llamacpp_runner
    from benchmarks.gateway.tree_mesh import check_tree, describe, same_services

    old = check_tree(args.ab_tree, "--ab-tree")
    trees = {"new": Path.cwd().resolve(), "old": old}
    cloud_streams = [int(s) for s in args.cloud_streams.split(",") if s]
    if args.cloud and args.cloud_max_active < max(cloud_streams):
        parser.error(f"--cloud-max-active must be at least the largest --cloud-streams ({max(cloud_streams)})")
    described = {"new": describe(None), "old": describe(old)}
    report: dict[str, Any] = {
        "benchmark": "tiers_ab",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_1m_start": os.getloadavg()[0]},
        "command": "meshserve bench tiers-ab " + " ".join(argv if argv is not None else sys.argv[1:]),
        "trees": described,
        "same_services": same_services(described["new"], described["old"]),
        "edge": None,
        "cloud": None,
    }
    if args.edge:
        report["edge"] = asyncio.run(
            edge_ab(
                trees,
                threads=args.threads,
                engine=args.engine,
                max_tokens=args.max_tokens,
                streams=args.streams,
                rounds=args.rounds,
                llama=llamacpp_runner(args, [1, args.streams]),
                start_timeout_s=args.start_timeout,
            )
        )
        report["machine"]["load_avg_1m_after_edge"] = os.getloadavg()[0]
    if args.cloud:
        report["cloud"] = asyncio.run(
            cloud_ab(
                trees,
                streams=cloud_streams,
                max_tokens=args.cloud_max_tokens,
                requests_per_stream=args.cloud_requests_per_stream,
                rounds=args.cloud_rounds,
                max_active=args.cloud_max_active,
                start_timeout_s=args.start_timeout,
                request_timeout_s=args.request_timeout,
            )
        )
    report["machine"]["load_avg_1m_end"] = os.getloadavg()[0]
    report["targets"] = targets(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tiers_ab.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "tiers_ab.md").write_text(markdown(report))
    print("\n".join(output_lines(report)))
    return 0 if all(row.get("pass", True) for row in report["targets"]) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
