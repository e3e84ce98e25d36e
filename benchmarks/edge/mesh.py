"""Edge tier benchmark through the whole mesh: roofline share, aggregate throughput, memory per stream.

``python -m benchmarks.edge.mesh`` starts the mesh (gateway -> router -> one edge worker; no cloud worker),
sends greedy requests with the EDGE hint and the response cache bypassed, and reports:

* single-stream decode tokens/s as a share of the memory-bandwidth roofline: the bytes of weights
  one decode step reads (every initializer except the embedding table, of which one row is read)
  divided into the machine's measured read bandwidth (numpy sums over a buffer far larger than the
  caches, best of 3, the better of 1 thread and the worker's thread count);
* aggregate tokens/s at 1, 4 and 16 concurrent streams (all tokens / wall time of the round; the
  rounds of all counts are interleaved ``--mesh-repeats`` times and each number is the median), and
  the edge worker's CPU time per token in each round (less sensitive to other jobs than wall time);
* memory per stream: the edge worker's peak RSS during the 16-stream round minus its idle RSS, / 16;
* the same rounds on the engine alone, in-process (``--direct``, default on): the batched engine (and
  its one-row variant for a lone sequence) and the og engine interleaved, with CPU time per token
  (benchmarks/edge/direct.py).

* onnxruntime-genai's own single stream on the same INT4 model, in this process (``og.Generator``, its
  default session options but the worker's thread count), one round after each single-stream mesh
  round (``--ortgenai``, default on), and llama.cpp at 1 and 16 streams on the same GGUF requantized to
  Q4_0 when a llama.cpp build is found (:mod:`benchmarks.edge.llamacpp`), one run right after each
  16-stream mesh round (medians of those runs).

Writes ``docs/benchmarks/edge.{json,md}`` and ends with issue 27's targets, judged: the mesh's single
stream >= 1.0x onnxruntime-genai's (same run, interleaved), 16 streams >= 1.25x llama.cpp's 16-stream
throughput (same run, interleaved; SKIPPED, with the reason, without a llama.cpp build); issue 6's
roofline share and 16-vs-1 ratio follow as references. Numbers from a busy machine are not comparable
with a quiet one: the load average at the start and end is recorded, re-run with nothing else running.
``--streams`` without 1 (e.g. ``--streams 16``) runs the other counts; what needs a lone stream (the
roofline share, onnxruntime-genai's ratio, N vs 1) is reported as not measured, with that reason.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from benchmarks import earlier_runs
from benchmarks.edge import direct as edge_direct
from benchmarks.edge import llamacpp
from benchmarks.stats import StreamSample, summarize, time_stream
from services.common.model_paths import model_paths
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.local.mesh import DEV_API_KEY, Mesh, MeshConfig

PROMPT = "Once upon a time, in a small village by the sea, there lived"  # decodes 48+ tokens before EOS


def read_bandwidth_gbs(threads: int = 1, megabytes: int = 512, repeats: int = 3) -> float:
    """Sustained read bandwidth in GB/s: ``threads`` numpy reductions (they release the GIL) over
    disjoint parts of a buffer much larger than the caches; best of ``repeats``."""
    from concurrent.futures import ThreadPoolExecutor

    data = np.ones(megabytes * (1 << 20) // 4, dtype=np.float32)
    parts = np.array_split(data, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(lambda part: float(part.sum()), parts))
            best = min(best, time.perf_counter() - start)
    return data.nbytes / best / 1e9


def weight_bytes_per_token(model_dir: Path) -> tuple[int, int]:
    """(bytes a decode step reads, all weight bytes) of an ONNX model: initializers minus the embedding gather."""
    import onnx
    from onnx.external_data_helper import uses_external_data

    model = onnx.load(str(model_dir / "model.onnx"), load_external_data=False)
    total = per_token = 0
    for init in model.graph.initializer:
        if uses_external_data(init):
            size = int(next(e.value for e in init.external_data if e.key == "length"))
        else:
            size = len(init.raw_data) or onnx.numpy_helper.to_array(init).nbytes
        total += size
        if "embed_tokens" not in init.name:
            per_token += size
    return per_token, total


async def mesh_stream(stub: inference_pb2_grpc.InferenceStub, max_tokens: int) -> StreamSample:
    """One greedy request of :data:`PROMPT` through a gateway (EDGE hint, response cache bypassed), timed."""
    request = pb.GenerateRequest(
        prompt=PROMPT,
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0),
        routing=pb.RoutingOptions(tier=pb.TIER_EDGE, cache_policy=pb.CACHE_POLICY_BYPASS),
    )
    return await time_stream(lambda: stub.Generate(request, metadata=(("authorization", f"Bearer {DEV_API_KEY}"),)))


def _rss(pid: int) -> int:
    import psutil

    return int(psutil.Process(pid).memory_info().rss)


def _cpu_s(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def ortgenai_model(model_dir: Path, threads: int) -> Any:
    """onnxruntime-genai's model as a user would load it: its defaults, ``threads`` intra-op threads."""
    import onnxruntime_genai as og

    config = og.Config(str(model_dir))
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    return og.Model(config)


def ortgenai_round(model: Any, prompt: list[int], max_tokens: int) -> dict[str, float]:
    """One greedy stream on ``og.Generator``: decode tokens/s as the mesh rounds count it (tokens after
    the first over the time between the first and the last)."""
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + max_tokens, do_sample=False)
    generator = og.Generator(model, params)
    start = time.perf_counter()
    generator.append_tokens(prompt)
    stamps: list[float] = []
    while len(stamps) < max_tokens and not generator.is_done():
        generator.generate_next_token()
        generator.get_next_tokens()
        stamps.append(time.perf_counter())
    return {
        "tokens": len(stamps),
        "ttft_ms": 1000 * (stamps[0] - start),
        "decode_tokens_per_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
    }


def worker_int4_kernel() -> str:
    """The int4 kernel the mesh's edge worker runs: its setting (the worker inherits this environment),
    resolved by the worker's own rule (:func:`services.edge_worker.server.int4_kernel`)."""
    from services.common.config import load_settings
    from services.edge_worker.config import EdgeWorkerSettings
    from services.edge_worker.server import int4_kernel

    return int4_kernel(load_settings(EdgeWorkerSettings))


async def mesh_round(stub: inference_pb2_grpc.InferenceStub, streams: int, max_tokens: int, pid: int) -> dict[str, Any]:
    """``streams`` requests at once through a gateway: aggregate tok/s (all tokens / wall time), stream
    timings, and the worker ``pid``'s CPU per token and peak RSS during the round."""
    peak = _rss(pid)
    stop = asyncio.Event()

    async def watch() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, _rss(pid))
            await asyncio.sleep(0.05)  # sampling memory, not waiting for readiness

    watcher = asyncio.create_task(watch())
    cpu = _cpu_s(pid)
    start = time.perf_counter()
    samples = await asyncio.gather(*(mesh_stream(stub, max_tokens) for _ in range(streams)))
    wall = time.perf_counter() - start
    cpu = _cpu_s(pid) - cpu
    stop.set()
    await watcher
    tokens = sum(s.tokens for s in samples)
    return {
        "streams": streams,
        "tokens": tokens,
        "wall_s": wall,
        "aggregate_tokens_per_s": tokens / wall,
        "worker_cpu_ms_per_token": 1000 * cpu / max(1, tokens),
        "peak_rss_bytes": peak,
        **summarize(list(samples)),
    }


NO_SINGLE_STREAM = "no single-stream round: --streams has no 1"
"""Why the measures of a lone stream are absent (the roofline share, onnxruntime-genai's ratio, N vs 1)."""


def parse_stream_counts(text: str) -> list[int]:
    """``--streams``: comma-separated counts, each at least 1, sorted and without repeats (the last is
    the largest, the count llama.cpp is compared at). Raises ValueError with the fix."""
    try:
        counts = sorted({int(n) for n in text.split(",") if n.strip()})
    except ValueError:
        raise ValueError(f"--streams must be comma-separated whole numbers such as 1,4,16; got {text!r}") from None
    if not counts or counts[0] < 1:
        raise ValueError(f"--streams needs at least one count and every count at least 1, such as 1,4,16; got {text!r}")
    return counts


def single_stream_measures(rounds: list[dict[str, Any]], roofline: float) -> dict[str, float | None]:
    """What the lone stream's round gives: its decode tok/s, its share of the roofline, and the largest
    count's aggregate tok/s and worker CPU per token against it; each None without a one-stream round
    (the rest of the report stands without them)."""
    single = next((r for r in rounds if r["streams"] == 1), None)
    if single is None:
        return dict.fromkeys(
            (
                "single_stream_decode_tokens_per_s",
                "single_stream_roofline_share",
                "scaling_top_vs_single",
                "cpu_scaling_top_vs_single",
            )
        )
    top = rounds[-1]
    return {
        "single_stream_decode_tokens_per_s": single["decode_tokens_per_s"],
        "single_stream_roofline_share": single["decode_tokens_per_s"] / roofline,
        "scaling_top_vs_single": top["aggregate_tokens_per_s"] / single["aggregate_tokens_per_s"],
        "cpu_scaling_top_vs_single": single["worker_cpu_ms_per_token"] / top["worker_cpu_ms_per_token"],
    }


def _median_round(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-key median of one stream count's rounds (peak RSS: the largest)."""
    out: dict[str, Any] = {"streams": samples[0]["streams"], "repeats": len(samples)}
    for key, value in samples[0].items():
        if key in out or not isinstance(value, int | float):
            continue
        values = [s[key] for s in samples]
        out[key] = max(values) if key == "peak_rss_bytes" else statistics.median(values)
    return out


async def run(
    max_tokens: int,
    threads: int,
    stream_counts: Sequence[int],
    engine: str = "batched",
    repeats: int = 3,
    embed_router: bool = True,
    ortgenai: bool = True,
    llama: Callable[[], dict[str, Any]] | str | None = None,
) -> dict[str, Any]:
    """The mesh rounds; ``llama``: a function that runs llama.cpp once (:func:`llamacpp_runner`), called
    right after each round of the largest stream count (the same load, as onnxruntime-genai's reference
    after each single-stream round), or why it cannot run."""
    edge_dir = model_paths().edge_dir
    # onnxruntime-genai's reference is timed after each single-stream round: none without one
    og_model = ortgenai_model(edge_dir, threads) if ortgenai and 1 in stream_counts else None
    og_prompt: list[int] = []
    if og_model is not None:
        from tokenizers import Tokenizer

        og_prompt = list(Tokenizer.from_file(str(edge_dir / "tokenizer.json")).encode(PROMPT).ids)
        ortgenai_round(og_model, og_prompt, 4)  # warm-up
    per_token, total = weight_bytes_per_token(edge_dir)
    bandwidth = max(read_bandwidth_gbs(1), read_bandwidth_gbs(threads))
    config = MeshConfig(
        edge_workers=1,
        cloud_workers=0,
        edge_threads=threads,
        embed_router=embed_router,
        extra_env={
            "MESHSERVE_EDGE_WORKER_MAX_ACTIVE_SEQUENCES": str(max(stream_counts)),
            "MESHSERVE_EDGE_WORKER_MAX_QUEUE": str(2 * max(stream_counts)),
            "MESHSERVE_EDGE_WORKER_ENGINE": engine,
        },
    )
    load_start = os.getloadavg()[0]
    kernel = worker_int4_kernel()
    samples: dict[int, list[dict[str, Any]]] = {n: [] for n in stream_counts}
    og_rounds: list[dict[str, float]] = []
    llama_samples: list[dict[str, Any]] = []
    llama_found: str | None = llama if isinstance(llama, str) else None  # why llama.cpp was not measured
    async with Mesh(config, sink=lambda _name, _line: None) as mesh:
        proc = mesh.workers("edge")[0].proc
        assert proc is not None
        async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            await mesh_stream(stub, 4)  # warm the path
            idle = _rss(proc.pid)
            for repeat in range(repeats):  # interleaved: every count sees the same mix of load
                for n in stream_counts:
                    print(f"{n} streams (round {repeat + 1}/{repeats}) ...", file=sys.stderr, flush=True)
                    samples[n].append(await mesh_round(stub, n, max_tokens, proc.pid))
                    if n == 1 and og_model is not None:  # right after the mesh's single stream: same load
                        print("onnxruntime-genai, 1 stream ...", file=sys.stderr, flush=True)
                        og_rounds.append(ortgenai_round(og_model, og_prompt, max_tokens))
                    if n == max(stream_counts) and callable(llama) and not isinstance(llama_found, str):
                        print("llama.cpp ...", file=sys.stderr, flush=True)
                        try:
                            llama_samples.append(await asyncio.to_thread(llama))
                        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                            llama_found = f"llama.cpp run failed: {exc}"
    rounds = [_median_round(samples[n]) for n in stream_counts]
    roofline = bandwidth * 1e9 / per_token
    top = rounds[-1]
    return {
        "benchmark": "edge",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_avg_1m": load_start,
            "load_avg_1m_after_mesh": os.getloadavg()[0],
        },
        "command": f"python -m benchmarks.edge.mesh --max-tokens {max_tokens} --threads {threads} --engine {engine}"
        f" --mesh-repeats {repeats}" + ("" if embed_router else " --split-router"),
        "engine": engine,
        "int4_kernel": kernel if engine == "batched" else None,
        "embed_router": embed_router,
        "model_dir": str(edge_dir),
        "weight_bytes_total": total,
        "weight_bytes_per_token": per_token,
        "read_bandwidth_gbs": bandwidth,
        "roofline_tokens_per_s": roofline,
        **single_stream_measures(rounds, roofline),
        "idle_rss_bytes": idle,
        "memory_per_stream_bytes": (top["peak_rss_bytes"] - idle) / top["streams"],
        "rounds": rounds,
        "round_samples": [s for n in stream_counts for s in samples[n]],
        "ortgenai_rounds": og_rounds,
        "ortgenai_decode_tokens_per_s": (
            statistics.median(r["decode_tokens_per_s"] for r in og_rounds) if og_rounds else None
        ),
        "llamacpp": (
            {"skipped": llama_found or "llama.cpp not measured"}
            if llama_found is not None or not llama_samples
            else llamacpp.summary(llama_samples)
        ),
    }


def judged(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Issue 27's targets: ``{name: {"ratio", "target", "pass", ...}}`` or ``{name: {"skipped": why}}``."""
    out: dict[str, dict[str, Any]] = {}
    single = report.get("single_stream_decode_tokens_per_s")
    og = report.get("ortgenai_decode_tokens_per_s")
    if single is None:
        out["edge_single_stream_vs_ortgenai"] = {"skipped": NO_SINGLE_STREAM}
    elif og:
        ratio = single / og
        out["edge_single_stream_vs_ortgenai"] = {
            "ratio": ratio,
            "target": 1.0,
            "pass": ratio >= 1.0,
            "mesh_tokens_per_s": single,
            "ortgenai_tokens_per_s": og,
        }
    else:
        out["edge_single_stream_vs_ortgenai"] = {"skipped": "onnxruntime-genai not measured (--no-ortgenai)"}
    top = report["rounds"][-1]
    llama = report.get("llamacpp") or {"skipped": "llama.cpp not measured"}
    theirs = next((r for r in llama.get("rounds", []) if r["streams"] == top["streams"]), None)
    if theirs is not None:
        ratio = top["aggregate_tokens_per_s"] / theirs["aggregate_tokens_per_s"]
        out["edge_16_streams_vs_llamacpp"] = {
            "ratio": ratio,
            "target": 1.25,
            "pass": ratio >= 1.25,
            "streams": top["streams"],
            "mesh_tokens_per_s": top["aggregate_tokens_per_s"],
            "llamacpp_tokens_per_s": theirs["aggregate_tokens_per_s"],
        }
    else:
        out["edge_16_streams_vs_llamacpp"] = {"skipped": llama.get("skipped", f"no {top['streams']}-stream round")}
    return out


def _target_lines(name: str, found: dict[str, Any], detail: str) -> list[str]:
    """One judged ratio target: its TARGET line and ``detail`` formatted with the judged fields, or one
    SKIPPED line with the reason."""
    if "skipped" in found:
        return [f"TARGET {name}: SKIPPED ({found['skipped']})"]
    verdict = "PASS" if found["pass"] else "FAIL"
    return [f"TARGET {name}: {found['ratio']:.2f}x (target >= {found['target']}x): {verdict}", detail.format(**found)]


def targets(report: dict[str, Any]) -> list[str]:
    """Issue 27's two targets, judged (SKIPPED with the reason when a reference was not measured), then
    issue 6's roofline share and 16-vs-1 ratio as references."""
    top = report["rounds"][-1]["streams"]
    machine = report["machine"]
    busy = max(machine["load_avg_1m"], machine.get("load_avg_1m_after_mesh", 0.0)) > 0.5 * (machine["cpus"] or 1)
    warning = (
        [
            f"WARNING: load average {machine['load_avg_1m']:.1f} on {machine['cpus']} CPUs: other jobs share the "
            "CPU, so the bandwidth probe, the roofline share and the wall-clock ratios are noisy; re-run quiet"
        ]
        if busy
        else []
    )
    lines = [*warning]
    found = report.get("targets") or judged(report)
    lines += _target_lines(
        "edge_single_stream_vs_ortgenai",
        found["edge_single_stream_vs_ortgenai"],
        "  (single-stream decode through the mesh {mesh_tokens_per_s:.1f} tok/s vs onnxruntime-genai "
        "in-process {ortgenai_tokens_per_s:.1f} tok/s, medians of interleaved rounds)",
    )
    lines += _target_lines(
        "edge_16_streams_vs_llamacpp",
        found["edge_16_streams_vs_llamacpp"],
        "  ({streams} streams through the mesh {mesh_tokens_per_s:.1f} tok/s vs llama.cpp Q4_0 "
        "{llamacpp_tokens_per_s:.1f} tok/s, generated tokens over wall time, prefill included)",
    )
    if report.get("single_stream_roofline_share") is None:
        reference = f"{NO_SINGLE_STREAM}, so no roofline share and no {top}-vs-1 ratios"
    else:
        reference = (
            f"single-stream decode / memory-bandwidth roofline {100 * report['single_stream_roofline_share']:.0f} %; "
            f"aggregate tok/s at {top} streams / 1 stream {report['scaling_top_vs_single']:.2f}x; tokens per worker "
            f"CPU-second at {top} / 1 stream {report['cpu_scaling_top_vs_single']:.2f}x"
        )
    return [
        *lines,
        f"  (reference, issue 6: {reference}; load average {machine['load_avg_1m']:.1f} at the start)",
    ]


def markdown(report: dict[str, Any]) -> str:
    mib = 1 << 20
    lines = [
        "# Edge tier through the whole mesh",
        "",
        f"Measured {report['date']} on {report['machine']} with `{report['command']}`.",
        f"Greedy requests with the EDGE hint, response cache bypassed, one edge worker ({report['engine']} engine"
        + (f", int4 kernel {report['int4_kernel']})" if report.get("int4_kernel") else ")")
        + (
            "; the router inside the gateway's process (the default layout)."
            if report.get("embed_router")
            else "; gateway and router as processes (`--split-router`)."
        ),
        "",
        f"- weights read per decode step: {report['weight_bytes_per_token'] / mib:.1f} MiB "
        f"(all weights {report['weight_bytes_total'] / mib:.1f} MiB; the embedding table is a gather)",
        f"- measured read bandwidth: {report['read_bandwidth_gbs']:.2f} GB/s "
        f"-> roofline {report['roofline_tokens_per_s']:.1f} tokens/s",
        (
            f"- single-stream decode: {report['single_stream_decode_tokens_per_s']:.1f} tokens/s = "
            f"**{report['single_stream_roofline_share'] * 100:.0f} % of the roofline**"
            if report.get("single_stream_roofline_share") is not None
            else f"- single-stream decode: not measured ({NO_SINGLE_STREAM})"
        ),
        f"- memory per stream (peak RSS at {report['rounds'][-1]['streams']} streams - idle, / streams): "
        f"{report['memory_per_stream_bytes'] / mib:.1f} MiB (idle worker {report['idle_rss_bytes'] / mib:.0f} MiB)",
        "",
        *(f"- {line.strip()}" for line in targets(report)),
        "",
        f"Medians of {report['rounds'][0].get('repeats', 1)} interleaved rounds per stream count:",
        "",
        f"| streams | aggregate tok/s | x {_base_label(report['rounds'][0]['streams'])} | worker CPU ms/token | "
        "TTFT p50 (ms) | ITL p50 (ms) | decode tok/s per stream |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = report["rounds"][0]["aggregate_tokens_per_s"] or float("nan")
    for r in report["rounds"]:
        lines.append(
            f"| {r['streams']} | {r['aggregate_tokens_per_s']:.1f} | {r['aggregate_tokens_per_s'] / base:.2f} | "
            f"{r.get('worker_cpu_ms_per_token', float('nan')):.1f} | {r['ttft_ms_p50']:.0f} | "
            f"{r['itl_ms_p50']:.1f} | {r['decode_tokens_per_s']:.1f} |"
        )
    lines += _reference_lines(report)
    if report.get("direct"):
        lines += edge_direct.markdown(report["direct"], report["roofline_tokens_per_s"])
    return "\n".join(lines) + "\n"


def _base_label(streams: int) -> str:
    """The column of each round's aggregate tok/s over the first (smallest) count's."""
    return "single" if streams == 1 else f"{streams} streams"


def _reference_lines(report: dict[str, Any]) -> list[str]:
    """Each reference run next to the mesh round it followed (the spread behind the medians)."""
    samples = report.get("round_samples", [])
    top = report["rounds"][-1]["streams"]
    pairs = []
    og = [r["decode_tokens_per_s"] for r in report.get("ortgenai_rounds", [])]
    if og:
        mesh = [r["decode_tokens_per_s"] for r in samples if r["streams"] == 1]
        pairs.append(("1 stream, decode tok/s: the mesh", mesh, "onnxruntime-genai", og))
    llama_top = [
        r["aggregate_tokens_per_s"]
        for s in report.get("llamacpp", {}).get("samples", [])
        for r in s["rounds"]
        if r["streams"] == top
    ]
    if llama_top:
        mesh = [r["aggregate_tokens_per_s"] for r in samples if r["streams"] == top]
        pairs.append((f"{top} streams, aggregate tok/s: the mesh", mesh, "llama.cpp", llama_top))
    if not pairs:
        return []
    lines = ["", "Round by round (each reference run right after the mesh round it is compared with):", ""]
    for label, mesh, name, theirs in pairs:
        lines.append(f"- {label} {', '.join(f'{v:.1f}' for v in mesh)}; {name} {', '.join(f'{v:.1f}' for v in theirs)}")
    return lines


def llamacpp_runner(args: argparse.Namespace, counts: Sequence[int]) -> Callable[[], dict[str, Any]] | str:
    """A function that runs llama.cpp once at 1 and the largest stream count (:func:`llamacpp.measure`),
    or why it cannot run."""
    from tokenizers import Tokenizer

    from services.models.sources import PrepareError, default_source

    tools = llamacpp.find_tools(args.llama_cpp_bin)
    if isinstance(tools, str):
        return tools
    try:
        source = default_source()
    except PrepareError as exc:
        return f"the shipped GGUF is not installed: {exc}"
    edge_dir = model_paths().edge_dir
    prompt = len(Tokenizer.from_file(str(edge_dir / "tokenizer.json")).encode(PROMPT).ids)

    def once() -> dict[str, Any]:
        return llamacpp.measure(
            tools,
            Path(source.location),
            args.llama_cpp_dir,
            threads=args.threads,
            prompt_tokens=prompt,
            max_tokens=args.max_tokens,
            streams=sorted({1, max(counts)}),
        )

    return once


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshserve bench edge", description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per request (default 48)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="edge worker intra-op threads")
    parser.add_argument("--streams", default="1,4,16", help="comma-separated stream counts (default 1,4,16)")
    parser.add_argument("--engine", choices=("batched", "og"), default="batched", help="edge engine in the mesh")
    parser.add_argument(
        "--direct", action=argparse.BooleanOptionalAction, default=True, help="also time both engines in-process"
    )
    parser.add_argument(
        "--mesh-repeats", type=int, default=5, help="interleaved mesh rounds per count (median; default 5)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="in-process rounds per point (median; default 3)")
    parser.add_argument(
        "--direct-engines",
        default="batched,batched-native,og",
        help="in-process engines (comma-separated; batched = the MLAS kernels, batched-native = ours)",
    )
    parser.add_argument(
        "--split-router",
        action="store_true",
        help="the mesh with the router as its own process (meshserve up --split-router)",
    )
    parser.add_argument(
        "--ortgenai",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time onnxruntime-genai's single stream after each single-stream mesh round (issue 27's reference)",
    )
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
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"), help="output directory")
    args = parser.parse_args(argv)
    try:
        counts = parse_stream_counts(args.streams)
    except ValueError as exc:
        parser.error(str(exc))
    report = asyncio.run(
        run(
            args.max_tokens,
            args.threads,
            counts,
            args.engine,
            args.mesh_repeats,
            embed_router=not args.split_router,
            ortgenai=args.ortgenai,
            llama=llamacpp_runner(args, counts),
        )
    )
    if args.direct:
        print("engines in-process ...", file=sys.stderr, flush=True)
        from tokenizers import Tokenizer

        edge_dir = model_paths().edge_dir
        prompt = list(Tokenizer.from_file(str(edge_dir / "tokenizer.json")).encode(PROMPT).ids)
        report["direct"] = edge_direct.measure(
            tuple(args.direct_engines.split(",")),
            edge_dir,
            prompt,
            threads=args.threads,
            counts=counts,
            max_tokens=args.max_tokens,
            repeats=args.repeats,
        )
        report["machine"]["load_avg_1m_end"] = os.getloadavg()[0]
    report["targets"] = judged(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "edge.json").write_text(json.dumps(report, indent=2) + "\n")
    earlier_runs.write(args.out / "edge.md", markdown(report))
    print(markdown(report))
    print("\n".join(targets(report)))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
