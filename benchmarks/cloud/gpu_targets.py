"""Issue 22's targets for the cloud tier on a GPU, measured in one run (``python -m benchmarks.cloud.gpu``).

For each shape (SmolLM2-135M's, and Llama-3.2-1B's: 16 layers, hidden 2048, MLP 8192, 32/8 heads, both
with SmolLM2's vocabulary and tokenizer) a random-weight checkpoint is built on the machine (decode
speed does not depend on weight values; EOS is unset, so every stream decodes exactly ``--tokens``):

* anchors: transformers ``generate`` with ``cache_implementation="static"`` (compiled decode on CUDA)
  for 1 stream and for one static batch of ``--streams`` equal prompts;
* the engine (``CloudEngine``, static decode steps: CUDA graphs on a GPU) for 1 stream and for
  ``--streams`` concurrent streams of distinct prompts through continuous batching, stepped in this
  thread as the worker's engine loop steps it (driver.py), each as tokens/s and as a share of the HBM
  roofline (bytes one decode step reads / the measured device copy bandwidth);
* checks: greedy fp32 on the device == the CPU engine (135M shape), the graph path == the eager path
  in bf16 for the same batch, the KV budget held through the run, the graphs' extra memory;
* through the service: ``Generate`` over gRPC to a ``python -m services.gpu_worker`` process, TTFT
  and tokens/s at 1 and ``--streams`` streams.

Each target prints as ``TARGET <name>: <value> (target <bound>): PASS|FAIL``; the report (json and a
block of docs/benchmarks/cloud_gpu.md between markers) goes to ``--out``. ``--device cpu --tiny`` runs
the same code on a 2-layer model in seconds (CI's smoke test); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import functools
import json
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.checkpoints import SHAPES, build_checkpoint
from benchmarks.engine_stepper import EngineStepper
from services.common.sampling import SamplingParams
from services.gpu_worker.engine import CloudEngine

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
MARK_BEGIN = "<!-- cloud_gpu targets: begin (written by python -m benchmarks.cloud.gpu) -->"
MARK_END = "<!-- cloud_gpu targets: end -->"


# -- setup --------------------------------------------------------------------------------------


def copy_bandwidth(device: torch.device) -> float:
    """Device memory bandwidth (bytes/s) of a large device-to-device copy, bytes read plus written."""
    if device.type != "cuda":
        n = 64 << 20
        a, b = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
        t = time.perf_counter()
        for _ in range(5):
            b.copy_(a)
        return 2 * 5 * n / (time.perf_counter() - t)
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1000
    del a, b
    torch.cuda.empty_cache()
    return 2 * 10 * n / seconds


def step_bytes(e: CloudEngine, streams: int, context: float) -> int:
    """Bytes one decode step of ``streams`` reads at least: every weight once, plus each stream's KV."""
    m = e.model
    weights = sum(t.numel() * t.element_size() for t in [m.embed, m.norm])  # the LM head is the embedding
    for layer in m.layers:
        weights += sum(x.weight.numel() * x.weight.element_size() for x in (layer.wqkv, layer.wo))
        weights += sum(x.weight.numel() * x.weight.element_size() for x in (layer.w_gate_up, layer.w_down))
        weights += (layer.ln1.numel() + layer.ln2.numel()) * layer.ln1.element_size()
    kv = m.config.kv_bytes_per_token(e.kv_dtype) * context * streams
    return int(weights + kv)


def prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- anchors: transformers generate ---------------------------------------------------------------


def anchor(
    path: Path, device: torch.device, dtype: torch.dtype, prompt: list[int], batch: int, tokens: int
) -> dict[str, Any]:
    """``generate`` with a static cache (compiled decode on CUDA) over ``batch`` copies of ``prompt``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=str(device)).eval()
    ids = torch.tensor([prompt] * batch, device=device)
    kw: dict[str, Any] = dict(max_new_tokens=tokens, do_sample=False, cache_implementation="static", pad_token_id=0)
    began = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, **kw)  # compiles (CUDA)
        _sync(device)
        warm = time.perf_counter() - began
        model.generate(ids, **kw)
        _sync(device)
        t = time.perf_counter()
        out = model.generate(ids, **kw)
        _sync(device)
        wall = time.perf_counter() - t
    new = out.shape[1] - ids.shape[1]
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"batch": batch, "tokens": new, "wall_s": wall, "tok_s": batch * new / wall, "warmup_s": warm}


# -- the engine -----------------------------------------------------------------------------------


def streams(e: CloudEngine, ps: list[list[int]], tokens: int) -> dict[str, Any]:
    """Every prompt added at once and stepped together (as the worker's engine loop runs them, driver.py);
    KV use read after every step."""
    peak = [0]

    def poll() -> None:
        peak[0] = max(peak[0], e.kv_usage().used_bytes)

    stepper = EngineStepper(e)
    steps0 = e.scheduler.steps_total
    static0 = e.static.steps if e.static else 0
    began = time.perf_counter()
    ids = [stepper.add(p, SamplingParams(max_tokens=tokens)) for p in ps]
    done = stepper.run(ids, raise_errors=True, after_step=poll)
    wall = time.perf_counter() - began
    counts = [len(done[i].tokens) for i in ids]
    assert all(n == tokens for n in counts), f"a stream ended early: {counts}"
    return {
        "streams": len(ps),
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": len(ps) * tokens / wall,
        "ttft_ms_median": 1000 * statistics.median(done[i].stamps[0] - began for i in ids),
        "steps": e.scheduler.steps_total - steps0,
        "static_steps": (e.static.steps if e.static else 0) - static0,
        "kv_peak_used_bytes": peak[0],
        "kv_budget_bytes": e.kv_usage().budget_bytes,
    }


def greedy_batch(e: CloudEngine, ps: list[list[int]], tokens: int) -> list[list[int]]:
    """Greedy tokens of ``ps`` added together (the same batch composition on every engine)."""
    stepper = EngineStepper(e)
    ids = [stepper.add(p, SamplingParams(max_tokens=tokens)) for p in ps]
    done = stepper.run(ids, raise_errors=True)
    return [done[i].tokens for i in ids]


def first_diffs(a: list[list[int]], b: list[list[int]]) -> list[int | None]:
    def diff(x: list[int], y: list[int]) -> int | None:
        return next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), None)

    return [diff(x, y) for x, y in zip(a, b, strict=True)]


def make_engine(path: Path, device: str, dtype: str, graphs: str, max_batch: int, budget: int) -> CloudEngine:
    return CloudEngine(
        str(path),
        model_id="bench",
        model_version="bench",
        device=device,
        dtype=dtype,
        kv_dtype=dtype if dtype != "float32" else "float16",
        kv_budget_bytes=budget,
        prefix_cache=False,
        decode_graphs=graphs,
        max_batch=max_batch,
    )


def engine_rows(path: Path, args: argparse.Namespace, bandwidth: float) -> dict[str, Any]:
    device = torch.device(args.device)
    before = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    e = make_engine(
        path, args.device, args.dtype, "auto" if device.type == "cuda" else "on", args.streams, args.kv_budget
    )
    out: dict[str, Any] = {"decode_graphs": e.decode_graphs}
    try:
        if device.type == "cuda":
            out["engine_reserved_bytes"] = torch.cuda.memory_reserved(device) - before
        vocab = e.info.vocab_size
        ps = prompts(vocab, args.streams, args.prompt_tokens, seed=1)
        if e.static is not None:  # capture every width the runs reach now, not inside a timed run
            need = -(-(args.prompt_tokens + args.tokens) // e.block_tokens)
            last = next((i for i, w in enumerate(e.static.widths) if w >= need), len(e.static.widths) - 1)
            for width in e.static.widths[: last + 1]:
                e.static.capture_all(width)
        streams(e, ps[:2], 8)  # warm-up: kernels, allocator
        one = streams(e, ps[:1], args.tokens)
        many = streams(e, ps, args.tokens)
        context = args.prompt_tokens + args.tokens / 2
        for row, n in ((one, 1), (many, args.streams)):
            row["step_bytes"] = step_bytes(e, n, context)
            row["roofline_tok_s"] = n * bandwidth / row["step_bytes"]
            row["roofline_share"] = row["tok_s"] / row["roofline_tok_s"]
        out["one"], out["many"] = one, many
        out["graph_bytes"] = e.static.graph_bytes if e.static else 0
        out["graphs"] = len(e.static._graphs) if e.static else 0
        cache_bytes = sum(t.numel() * t.element_size() for t in e.cache.k + e.cache.v)
        out["kv_cache_bytes"] = cache_bytes
        out["kv_budget_respected"] = cache_bytes <= args.kv_budget and all(
            r["kv_peak_used_bytes"] <= r["kv_budget_bytes"] for r in (one, many)
        )
        # The same batch on the eager path (graphs off), same dtype: tokens should match.
        batch = ps[: args.compare_streams]
        graph_tokens = greedy_batch(e, batch, args.compare_tokens)
    finally:
        e.close()
    eager = make_engine(path, args.device, args.dtype, "off", args.streams, args.kv_budget)
    try:
        eager_tokens = greedy_batch(eager, batch, args.compare_tokens)
    finally:
        eager.close()
    diffs = first_diffs(graph_tokens, eager_tokens)
    out["graph_vs_eager"] = {"sequences": len(batch), "equal": sum(d is None for d in diffs), "first_diffs": diffs}
    return out


def parity_fp32(path: Path, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Greedy fp32 tokens: the engine on ``--device`` (static steps) vs the CPU engine (eager)."""
    ps = prompts(vocab, 4, args.prompt_tokens, seed=2)
    runs = {}
    for device in (args.device, "cpu"):
        e = make_engine(path, device, "float32", "auto" if device == "cuda" else "off", 8, 64 << 20)
        try:
            runs[device] = greedy_batch(e, ps, args.compare_tokens)
        finally:
            e.close()
    diffs = first_diffs(runs[args.device], runs["cpu"])
    return {
        "sequences": len(ps),
        "tokens": args.compare_tokens,
        "equal": sum(d is None for d in diffs),
        "first_diffs": diffs,
    }


# -- through the service --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _grpc_rows(port: int, vocab: int, args: argparse.Namespace) -> dict[str, Any]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.common.config import DEFAULT_INTERNAL_TOKEN
    from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
    from services.common.pb.meshserve.v1 import inference_pb2

    meta = (("x-meshserve-internal-token", DEFAULT_INTERNAL_TOKEN), ("x-request-id", "bench"))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + args.grpc_start_s
        while True:
            try:
                r = await health.Check(health_pb2.HealthCheckRequest(service="meshserve.internal.v1.Worker"), timeout=2)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gpu_worker process did not serve within {args.grpc_start_s} s")
            await asyncio.sleep(0.5)
        stub = worker_pb2_grpc.WorkerStub(channel)

        async def one(prompt: list[int], began: float) -> tuple[float, int]:
            params = inference_pb2.SamplingParams(max_tokens=args.tokens)
            start = worker_pb2.WorkerStart(prompt_token_ids=prompt, sampling=params)

            async def frames() -> Any:
                yield worker_pb2.WorkerRequest(start=start)

            ttft, n = 0.0, 0
            async for frame in stub.Generate(frames(), metadata=meta):
                if frame.token_ids and not n:
                    ttft = time.perf_counter() - began
                n += len(frame.token_ids)
            return ttft, n

        rows: dict[str, Any] = {}
        ps = prompts(vocab, args.streams, args.prompt_tokens, seed=3)
        await one(ps[0], time.perf_counter())  # warm-up
        for n in (1, args.streams):
            began = time.perf_counter()
            results = await asyncio.gather(*(one(p, began) for p in ps[:n]))
            wall = time.perf_counter() - began
            tokens = sum(r[1] for r in results)
            rows[str(n)] = {
                "streams": n,
                "tokens": tokens,
                "wall_s": wall,
                "tok_s": tokens / wall,
                "ttft_ms_median": 1000 * statistics.median(r[0] for r in results),
            }
        return rows


def grpc_rows(path: Path, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """A ``python -m services.gpu_worker`` process on the device; Generate calls over gRPC."""
    port = _free_port()
    env = dict(
        os.environ,
        MESHSERVE_GPU_WORKER_MODEL=str(path),
        MESHSERVE_GPU_WORKER_MODEL_VERSION="bench",
        MESHSERVE_GPU_WORKER_DEVICE=args.device,
        MESHSERVE_GPU_WORKER_DTYPE=args.dtype,
        MESHSERVE_GPU_WORKER_PORT=str(port),
        MESHSERVE_GPU_WORKER_MAX_ACTIVE_SEQUENCES=str(args.streams),
        MESHSERVE_GPU_WORKER_MAX_QUEUE=str(args.streams),
        MESHSERVE_GPU_WORKER_KV_BUDGET_BYTES=str(args.kv_budget),
        MESHSERVE_GPU_WORKER_PREFIX_CACHE="false",
        MESHSERVE_GPU_WORKER_DECODE_GRAPHS="auto" if args.device == "cuda" else "on",
    )
    log = Path(args.out) / "cloud_gpu_worker.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.gpu_worker"], env=env, stdout=f, stderr=subprocess.STDOUT
        )
    try:
        return asyncio.run(_grpc_rows(port, vocab, args))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _as_str(fn: Callable[[], Path]) -> str:
    return str(fn())


# -- the run --------------------------------------------------------------------------------------


def target(name: str, value: float, bound: float, unit: str = "", at_least: bool = True) -> dict[str, Any]:
    ok = value >= bound if at_least else value <= bound
    line = f"TARGET {name}: {value:,.2f}{unit} (target {'>=' if at_least else '<='} {bound:,.2f}{unit}): "
    line += "PASS" if ok else "FAIL"
    return {"name": name, "value": value, "bound": bound, "pass": ok, "line": line}


def run(args: argparse.Namespace, progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """The whole run; ``progress(report)`` after each section (the report so far survives a timeout).

    The engine rows and checks of every shape come first, the transformers anchors last: their compiles
    take minutes, and a run cut off by the time limit should have lost the least important rows."""
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    report: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": f"{device} ({name})",
        "dtype": args.dtype,
        "torch": torch.__version__,
        "tokens": args.tokens,
        "streams": args.streams,
        "prompt_tokens": args.prompt_tokens,
        "command": getattr(args, "command", "python -m benchmarks.cloud.gpu " + " ".join(sys.argv[1:])),
        "shapes": {},
        "targets": [],
    }
    began = time.monotonic()

    def section(where: dict[str, Any], key: str, fn: Callable[[], Any]) -> Any:
        """One part of the report; a failure is recorded and the others still run."""
        t = time.monotonic()
        try:
            where[key] = fn()
        except Exception:
            report.setdefault("errors", {})[f"{where.get('shape', '')}/{key}".lstrip("/")] = traceback.format_exc()
            print(traceback.format_exc(), file=sys.stderr, flush=True)
        took = time.monotonic() - t
        print(f"{where.get('shape', '')} {key} ({took:.1f} s): {json.dumps(where.get(key))}", flush=True)
        report["targets"] = [t for rows in report["shapes"].values() for t in shape_targets(args, rows)]
        report["wall_s"] = time.monotonic() - began
        if progress is not None:
            progress(report)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return where.get(key)

    section(report, "copy_bandwidth_bytes_s", lambda: copy_bandwidth(device))
    bandwidth = report.get("copy_bandwidth_bytes_s") or 1.0
    work = Path(tempfile.mkdtemp(prefix="cloud_gpu_"))
    tok = Path(args.tokenizer)
    checkpoints: dict[str, Path] = {}
    try:
        for shape in args.shapes:
            rows: dict[str, Any] = {"shape": shape}
            report["shapes"][shape] = rows
            build = functools.partial(build_checkpoint, shape, tok, work / shape, device, dtype)
            path = section(rows, "checkpoint", functools.partial(_as_str, build))
            if path is not None:
                checkpoints[shape] = Path(path)
                run_shape(args, rows, checkpoints[shape], bandwidth, section)
        for shape, ckpt in checkpoints.items():
            if not args.skip_anchors:
                run_anchors(args, report["shapes"][shape], ckpt, section)
        for t in report["targets"]:
            print(t["line"], flush=True)
        for shape, rows in report["shapes"].items():
            for r in (rows.get("engine") or {}).get("one"), (rows.get("engine") or {}).get("many"):
                if r:
                    share = 100 * r["roofline_share"]
                    print(
                        f"ROOFLINE {shape} {r['streams']} streams: {r['tok_s']:.0f} tok/s = {share:.1f} %", flush=True
                    )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["wall_s"] = time.monotonic() - began
    return report


Section = Callable[[dict[str, Any], str, Callable[[], Any]], Any]


def run_shape(args: argparse.Namespace, rows: dict[str, Any], ckpt: Path, bandwidth: float, section: Section) -> None:
    """Every measurement of one shape into ``rows`` (each a section: a failure leaves the others)."""
    from transformers import AutoConfig

    vocab = int(AutoConfig.from_pretrained(ckpt).vocab_size)
    section(rows, "engine", lambda: engine_rows(ckpt, args, bandwidth))
    if rows["shape"] == args.parity_shape:
        section(rows, "parity_fp32_vs_cpu", lambda: parity_fp32(ckpt, args, vocab))
    if rows["shape"] == args.grpc_shape and not args.skip_grpc:
        section(rows, "grpc", lambda: grpc_rows(ckpt, args, vocab))


def run_anchors(args: argparse.Namespace, rows: dict[str, Any], ckpt: Path, section: Section) -> None:
    """transformers' static-cache ``generate``: 1 stream, and one batch of ``--streams`` equal prompts."""
    from transformers import AutoConfig

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    p = prompts(int(AutoConfig.from_pretrained(ckpt).vocab_size), 1, args.prompt_tokens, seed=4)[0]
    section(rows, "anchor_1", lambda: anchor(ckpt, device, dtype, p, 1, args.tokens))
    section(rows, "anchor_batch", lambda: anchor(ckpt, device, dtype, p, args.streams, args.tokens))


def shape_targets(args: argparse.Namespace, rows: dict[str, Any]) -> list[dict[str, Any]]:
    """The TARGET lines of one shape's rows (printed as they are made)."""
    shape, out = rows["shape"], []
    eng = rows.get("engine")
    if eng:
        if "anchor_1" in rows:
            name = f"{shape} 1 stream tok/s vs 1.5x static-cache compiled generate"
            out.append(target(name, eng["one"]["tok_s"], 1.5 * rows["anchor_1"]["tok_s"]))
        if "anchor_batch" in rows:
            name = f"{shape} {args.streams} streams tok/s vs compiled static batch"
            out.append(target(name, eng["many"]["tok_s"], rows["anchor_batch"]["tok_s"]))
        ge = eng["graph_vs_eager"]
        name = f"{shape} {args.dtype} graph path == eager path (sequences equal)"
        out.append(target(name, ge["equal"], ge["sequences"]))
        out.append(target(f"{shape} KV budget respected (1 = yes)", float(eng["kv_budget_respected"]), 1.0))
    pr = rows.get("parity_fp32_vs_cpu")
    if pr:
        name = f"{shape} greedy fp32 {args.device} == CPU engine (sequences equal)"
        out.append(target(name, pr["equal"], pr["sequences"]))
    return out


def _fmt(v: float | None, spec: str = ",.0f") -> str:
    return "-" if v is None else format(v, spec)


def markdown(r: dict[str, Any]) -> str:
    """The report block that goes between the markers in docs/benchmarks/cloud_gpu.md."""
    lines = [
        MARK_BEGIN,
        f"## Issue 22 targets: {r['device']}, {r['date']}",
        "",
        f"`{r['command']}`: random weights, {r['dtype']}, {r['tokens']} tokens per stream after a "
        f"{r['prompt_tokens']}-token prompt, EOS ignored; device copy bandwidth "
        f"{_fmt((r.get('copy_bandwidth_bytes_s') or 0) / 1e9, ',.0f')} GB/s (read + write); "
        f"run took {r.get('wall_s', 0):.0f} s.",
        "",
        "| shape | transformers static-cache generate, 1 stream | engine, 1 stream (roofline share) "
        f"| compiled static batch of {r['streams']} | engine, {r['streams']} streams (roofline share) "
        "| graphs' memory |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for shape, rows in r["shapes"].items():
        eng = rows.get("engine") or {}
        one, many = eng.get("one") or {}, eng.get("many") or {}

        def cell(row: dict[str, Any]) -> str:
            if not row:
                return "-"
            return f"{row['tok_s']:,.0f} ({100 * row['roofline_share']:.1f} %)"

        a1, ab = rows.get("anchor_1") or {}, rows.get("anchor_batch") or {}
        mem = f"{eng['graph_bytes'] / 2**20:,.0f} MiB ({eng['graphs']} graphs)" if eng.get("graphs") else "-"
        lines.append(
            f"| {shape} | {_fmt(a1.get('tok_s'))} | {cell(one)} | {_fmt(ab.get('tok_s'))} | {cell(many)} | {mem} |"
        )
    for shape, rows in r["shapes"].items():
        g = rows.get("grpc")
        if g:
            parts = [
                f"{v['streams']} streams {v['tok_s']:,.0f} tok/s, TTFT {v['ttft_ms_median']:.1f} ms" for v in g.values()
            ]
            lines += ["", f"Through gRPC (`Generate` to a gpu_worker process, {shape}): " + "; ".join(parts) + "."]
    lines += ["", "```"] + [t["line"] for t in r["targets"]] + ["```"]
    for name, error in r.get("errors", {}).items():
        lines += ["", f"**{name} failed:**", "", "```", error.strip()[-2000:], "```"]
    lines.append(MARK_END)
    return "\n".join(lines) + "\n"


def write_block(doc: Path, block: str) -> None:
    """Replace the targets block of ``doc`` (or put it after the title) and keep the rest."""
    text = doc.read_text() if doc.is_file() else "# Cloud engine on a GPU\n"
    if MARK_BEGIN in text and MARK_END in text:
        head, rest = text.split(MARK_BEGIN, 1)
        tail = rest.split(MARK_END, 1)[1].lstrip("\n")
        text = head + block + ("\n" + tail if tail else "")
    else:
        title, _, body = text.partition("\n")
        text = f"{title}\n\n{block}\n{body.lstrip(chr(10))}"
    doc.write_text(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="", help="bfloat16 on cuda, float32 on cpu (default)")
    parser.add_argument("--shapes", nargs="+", default=["135m", "1b"], choices=sorted(SHAPES))
    parser.add_argument("--tiny", action="store_true", help="CPU smoke: the 2-layer shape, 8 tokens, 4 streams")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per stream (EOS ignored)")
    parser.add_argument("--streams", type=int, default=64, help="concurrent streams (and the static batch)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--compare-streams", type=int, default=8, help="graph vs eager: streams in the batch")
    parser.add_argument("--compare-tokens", type=int, default=32, help="graph vs eager, fp32 parity: tokens")
    parser.add_argument("--kv-budget", type=int, default=2 << 30, help="KV budget of the engines (bytes)")
    parser.add_argument("--parity-shape", default="135m", help="shape of the fp32 device vs CPU check")
    parser.add_argument("--grpc-shape", default="1b", help="shape served over gRPC")
    parser.add_argument("--grpc-start-s", type=float, default=180.0)
    parser.add_argument("--skip-anchors", action="store_true")
    parser.add_argument("--skip-grpc", action="store_true")
    parser.add_argument(
        "--tokenizer", default="", help="dir with SmolLM2's tokenizer files (default: the prepared hf/)"
    )


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    if not args.dtype:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.tiny:
        args.shapes = ["tiny"]
        args.parity_shape = args.grpc_shape = "tiny"
        args.tokens, args.streams, args.prompt_tokens = min(args.tokens, 8), min(args.streams, 4), 8
        args.compare_streams, args.compare_tokens, args.kv_budget = 3, 6, 16 << 20
    if not args.tokenizer:
        from services.common.model_paths import model_paths

        args.tokenizer = str(model_paths().hf_dir)
    return args


def main_targets(args: argparse.Namespace) -> int:
    args = resolve(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save(report: dict[str, Any]) -> None:
        (out / "cloud_gpu_targets.json").write_text(json.dumps(report, indent=2) + "\n")
        write_block(out / "cloud_gpu.md", markdown(report))

    report = run(args, save)
    save(report)
    print(markdown(report))
    return 0
