"""Our int4 kernel (``kq4.c``) vs onnxruntime's MatMulNBits, one thread, on the edge model's matmul shapes.

Measured, all on one thread, interleaved round by round (every case and both implementations each
round), medians:

- **per shape** (K x N = 576x1536, 1536x576, 576x576, 576x192 at M = 1, 2, 16 rows): onnxruntime
  running a one-node MatMulNBits graph (bits 4, block 32, zero points, accuracy level 4: int8
  activations) through IOBinding, less the same session call on a one-Relu graph (what an
  onnxruntime run costs with nothing in it), against the kernel in a C loop, activation quantization
  included; the kernel through ctypes, one Python call per matmul, is listed too.
- **a decode step's matmuls** (``--layers`` 30 x 7 matmuls with distinct random weights, ~68 MB:
  more than the L3 cache, so the weights stream from memory as in the model): onnxruntime running
  one graph of 210 MatMulNBits nodes vs the kernel running the 210 matmuls in a C loop.

Checked in the same run: row invariance, bitwise (each row of every M = 1..16 call at every offset
against the row computed alone; onnxruntime's rows of an M=16 call against the rows alone, for
contrast), the largest difference to onnxruntime's output, and the relative error against a numpy
replica of the quantized math. A lead for issue 27, not a target: no TARGET line.

``meshserve bench edge-int4-kernel [--rounds 11] [--layers 30] [--model-rounds 15] [--ms 1 2 16]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from benchmarks.edge.int4_kernel.reference import (
    Weights,
    float_reference,
    matmulnbits_model,
    one_thread_session,
    quantized_reference,
    random_weights,
    relu_model,
)
from services.edge_worker.native.kernel import Int4MatMul, Kernel, KernelUnavailable, load_kernel

SHAPES = ((576, 1536), (1536, 576), (576, 576), (576, 192))
"""K x N of the edge model's MatMulNBits nodes (SmolLM2-135M: hidden 576, MLP 1536, 3 KV heads of 64)."""
LAYER = (("q", 576, 576), ("k", 576, 192), ("v", 576, 192), ("o", 576, 576), ("gate", 576, 1536),
         ("up", 576, 1536), ("down", 1536, 576))  # fmt: skip
"""The int4 matmuls of one decoder layer, in order."""
MAX_REL_TO_REFERENCE = 1e-5
"""The kernel against the float64 replica of its quantized math: fp32 rounding only (seen: < 4e-7)."""


def load_average() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _host() -> dict[str, str]:
    cpu = next((line.partition(":")[2].strip() for line in _cpuinfo() if line.startswith("model name")), "")
    gcc = subprocess.run(["gcc", "-dumpfullversion"], capture_output=True, text=True).stdout.strip()
    return {
        "cpu": cpu or platform.processor(),
        "cores": str(os.cpu_count()),
        "onnxruntime": ort.__version__,
        "numpy": np.__version__,
        "gcc": gcc,
        "l3_cache": _l3_cache(),
    }


def _l3_cache() -> str:
    """The L3 cache size as the kernel reports it (e.g. "32768K"), or "unknown"."""
    try:
        return Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return "unknown"


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def _calibrated(run: Callable[[int], float], batch_seconds: float) -> int:
    """Calls per timed batch so that one batch takes about ``batch_seconds``; run(n) returns seconds per call."""
    per_call = run(20)
    return max(10, int(batch_seconds / max(per_call, 1e-9)))


def _ort_timer(session: ort.InferenceSession, feeds: dict[str, npt.NDArray[np.float32]]) -> Callable[[int], float]:
    """Seconds per ``session.run_with_iobinding`` over n calls, inputs and outputs bound once."""
    binding = session.io_binding()
    rows = next(iter(feeds.values())).shape[0]
    values = [ort.OrtValue.ortvalue_from_numpy(value) for value in feeds.values()]
    for name, value in zip(feeds, values, strict=True):
        binding.bind_ortvalue_input(name, value)
    for out in session.get_outputs():  # preallocated: no allocation inside the timed runs
        values.append(ort.OrtValue.ortvalue_from_numpy(np.empty((rows, int(out.shape[1])), np.float32)))
        binding.bind_ortvalue_output(out.name, values[-1])

    def run(n: int, keep: list[ort.OrtValue] = values) -> float:
        go = session.run_with_iobinding
        start = time.perf_counter()
        for _ in range(n):
            go(binding)
        return (time.perf_counter() - start) / n

    return run


def _ctypes_timer(mm: Int4MatMul, a: npt.NDArray[np.float32]) -> Callable[[int], float]:
    """Seconds per kernel call made from Python (one ctypes call per matmul)."""
    out = np.empty((a.shape[0], mm.n), np.float32)
    qa, sa, sasum = mm.workspace(a.shape[0])
    args = (a.ctypes.data, a.shape[0], mm.k, mm.packed.ctypes.data, mm.n, out.ctypes.data,
            qa.ctypes.data, sa.ctypes.data, sasum.ctypes.data)  # fmt: skip

    buffers = (a, out, qa, sa, sasum)  # the kernel writes through the raw pointers: they must outlive run()

    def run(n: int, keep: tuple[npt.NDArray[Any], ...] = buffers) -> float:
        call = mm.kernel.lib.matmul_q4
        start = time.perf_counter()
        for _ in range(n):
            call(*args)
        return (time.perf_counter() - start) / n

    return run


def _kernel_timer(mm: Int4MatMul, a: npt.NDArray[np.float32]) -> Callable[[int], float]:
    """Seconds per kernel call, timed in the kernel's own C loop (no Python between calls)."""
    return lambda n: mm.time_ns(a, n) * 1e-9


def _test_rows(k: int, rng: np.random.Generator) -> npt.NDArray[np.float32]:
    """16 activation rows of very different magnitudes, one with an all-zero block (its scale is 0)."""
    rows = rng.standard_normal((16, k)) * rng.uniform(0.01, 100, (16, 1))
    rows[5, :40] = 0
    return rows.astype(np.float32)


def check_shape(
    mm: Int4MatMul, session: ort.InferenceSession, w: Weights, rows: npt.NDArray[np.float32]
) -> dict[str, Any]:
    """Row invariance (kernel and onnxruntime) and accuracy of one shape, on 16 rows."""
    feed = f"A{w.k}"
    alone = np.stack([mm(rows[i : i + 1])[0] for i in range(len(rows))])
    compared = mismatches = 0
    for m in range(1, len(rows) + 1):
        for start in range(len(rows) - m + 1):
            y = mm(rows[start : start + m])
            compared += m
            mismatches += int((y.view(np.uint32) != alone[start : start + m].view(np.uint32)).any(axis=1).sum())
    ort_all = session.run(None, {feed: rows})[0]
    ort_alone = np.stack([session.run(None, {feed: rows[i : i + 1]})[0][0] for i in range(len(rows))])
    y = mm(rows)
    qref = quantized_reference(rows, w)
    fref = float_reference(rows, w)
    return {
        "K": w.k,
        "N": w.n,
        "rows_compared": compared,
        "row_mismatches": mismatches,
        "ort_rows_differing_m16_vs_alone": int((ort_all != ort_alone).any(axis=1).sum()),
        "ort_max_diff_m16_vs_alone": float(np.abs(ort_all - ort_alone).max()),
        "max_abs_diff_vs_ort": float(np.abs(y - ort_all).max()),
        "max_rel_vs_quantized_reference": float(np.abs(y - qref).max() / np.abs(qref).max()),
        "max_abs_kernel_vs_float": float(np.abs(y - fref).max()),
        "max_abs_ort_vs_float": float(np.abs(ort_all - fref).max()),
        "max_abs_output": float(np.abs(fref).max()),
    }


def measure_shapes(
    kernel: Kernel, ms: Sequence[int], rounds: int, batch_seconds: float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per-shape timing rows (one per shape and M) and check rows (one per shape)."""
    rng = np.random.default_rng(0)
    cases: list[dict[str, Any]] = []
    checks = []
    for k, n in SHAPES:
        w = random_weights(k, n, seed=k * 7 + n)
        session = one_thread_session(matmulnbits_model([w]))
        empty = one_thread_session(relu_model(k))
        mm = Int4MatMul(kernel, w.b, w.scales, w.zero_points, k, n)
        checks.append(check_shape(mm, session, w, _test_rows(k, rng)))
        for m in ms:
            a = rng.standard_normal((m, k)).astype(np.float32)
            timers: dict[str, Callable[[int], float]] = {
                "ort": _ort_timer(session, {f"A{k}": a}),
                "ort_empty": _ort_timer(empty, {"A": a}),
                "kernel": _kernel_timer(mm, a),
                "kernel_ctypes": _ctypes_timer(mm, a),
            }
            reps = {name: _calibrated(timer, batch_seconds) for name, timer in timers.items()}
            cases.append({"K": k, "N": n, "M": m, "timers": timers, "reps": reps, "us": {t: [] for t in timers}})
    for r in range(rounds):
        for case in cases:  # interleaved: every case and implementation each round, under the same load
            for name, timer in case["timers"].items():
                case["us"][name].append(timer(case["reps"][name]) * 1e6)
        print(f"  shapes round {r + 1}/{rounds}; load average {load_average()}", flush=True)
    rows = []
    for case in cases:
        med = {name: statistics.median(v) for name, v in case["us"].items()}
        net = med["ort"] - med["ort_empty"]
        rows.append(
            {
                "K": case["K"],
                "N": case["N"],
                "M": case["M"],
                "ort_us": med["ort"],
                "ort_empty_us": med["ort_empty"],
                "ort_net_us": net,
                "kernel_us": med["kernel"],
                "kernel_ctypes_us": med["kernel_ctypes"],
                "speedup": net / med["kernel"],
                "samples_us": case["us"],
            }
        )
    return rows, checks


def measure_model(kernel: Kernel, ms: Sequence[int], layers: int, rounds: int, reps: int) -> dict[str, Any]:
    """A decode step's int4 matmuls (``layers`` x :data:`LAYER`, distinct weights): one onnxruntime graph vs
    the kernel over the same list, plus row invariance and the difference to onnxruntime over every output."""
    weights = [
        random_weights(k, n, seed=1000 * layer + k + n + len(name)) for layer in range(layers) for name, k, n in LAYER
    ]
    session = one_thread_session(matmulnbits_model(weights, {576: "X576", 1536: "X1536"}))
    packed = [Int4MatMul(kernel, w.b, w.scales, w.zero_points, w.k, w.n) for w in weights]
    ks = np.array([w.k for w in weights], np.int32)
    ns = np.array([w.n for w in weights], np.int32)
    weight_pointers = np.array([p.packed.ctypes.data for p in packed], np.uint64)
    rng = np.random.default_rng(1)
    top = max(ms)
    x = {
        576: rng.standard_normal((top, 576)).astype(np.float32),
        1536: rng.standard_normal((top, 1536)).astype(np.float32),
    }
    results: dict[int, dict[str, Any]] = {}
    timers: dict[int, dict[str, Callable[[int], float]]] = {}
    for m in ms:
        xm = {k: np.ascontiguousarray(v[:m]) for k, v in x.items()}
        outs = [np.empty((m, w.n), np.float32) for w in weights]
        widest = max(w.k for w in weights)  # one workspace serves every matmul of the list
        qa, sa, sasum = (
            np.empty(m * widest, np.int8),
            np.empty(m * widest // 32, np.float32),
            np.empty(m * widest // 32, np.float32),
        )
        keep = (xm, outs, qa, sa, sasum)
        a_pointers = np.array([xm[w.k].ctypes.data for w in weights], np.uint64)
        out_pointers = np.array([o.ctypes.data for o in outs], np.uint64)

        def run_kernel(n: int, m: int = m, a_pointers: Any = a_pointers, out_pointers: Any = out_pointers,
                       keep: Any = keep) -> float:  # fmt: skip
            _xm, _outs, qa, sa, sasum = keep
            ns_per_pass = kernel.lib.time_matmul_q4_list(
                n, len(weights), ks.ctypes.data, ns.ctypes.data, weight_pointers.ctypes.data,
                a_pointers.ctypes.data, out_pointers.ctypes.data, m, qa.ctypes.data, sa.ctypes.data,
                sasum.ctypes.data,
            )  # fmt: skip
            return float(ns_per_pass) * 1e-9

        run_kernel(1)
        ort_out = session.run(None, {"X576": xm[576], "X1536": xm[1536]})
        timers[m] = {"ort": _ort_timer(session, {"X576": xm[576], "X1536": xm[1536]}), "kernel": run_kernel}
        results[m] = {
            "M": m,
            "max_abs_diff_vs_ort": max(float(np.abs(o - y).max()) for o, y in zip(outs, ort_out, strict=True)),
            "kernel": outs,
            "ort": ort_out,
        }
    for m in ms:  # a row's outputs must not depend on how many rows came with it
        full, res = results[top], results[m]
        res["kernel_ops_rows_differing_vs_top"] = sum(
            not np.array_equal(a.view(np.uint32), b[:m].view(np.uint32))
            for a, b in zip(res["kernel"], full["kernel"], strict=True)
        )
        res["ort_ops_rows_differing_vs_top"] = sum(
            not np.array_equal(a, b[:m]) for a, b in zip(res["ort"], full["ort"], strict=True)
        )
    samples: dict[int, dict[str, list[float]]] = {m: {"ort": [], "kernel": []} for m in ms}
    for r in range(rounds):
        for m in ms:
            for name, timer in timers[m].items():
                samples[m][name].append(timer(reps) * 1e3)
        print(f"  model round {r + 1}/{rounds}; load average {load_average()}", flush=True)
    rows = []
    for m in ms:
        res = results[m]
        ort_ms, kernel_ms = statistics.median(samples[m]["ort"]), statistics.median(samples[m]["kernel"])
        rows.append(
            {
                "M": m,
                "ort_ms": ort_ms,
                "kernel_ms": kernel_ms,
                "speedup": ort_ms / kernel_ms,
                "ort_ms_range": [min(samples[m]["ort"]), max(samples[m]["ort"])],
                "kernel_ms_range": [min(samples[m]["kernel"]), max(samples[m]["kernel"])],
                "max_abs_diff_vs_ort": res["max_abs_diff_vs_ort"],
                "kernel_ops_rows_differing_vs_top": res["kernel_ops_rows_differing_vs_top"],
                "ort_ops_rows_differing_vs_top": res["ort_ops_rows_differing_vs_top"],
                "samples_ms": samples[m],
            }
        )
    ort_bytes = sum(w.b.nbytes + w.scales.nbytes + w.zero_points.nbytes for w in weights)
    return {
        "layers": layers,
        "matmuls": len(weights),
        "top_m": top,
        "weight_mb_matmulnbits": ort_bytes / 1e6,
        "weight_mb_kernel": sum(p.packed.nbytes for p in packed) / 1e6,
        "rounds": rounds,
        "reps": reps,
        "rows": rows,
    }


def markdown(report: dict[str, Any]) -> str:
    """The report page from the JSON payload :func:`main` writes."""
    host, model = report["host"], report["model"]
    lines = [
        "# Edge tier: our int4 kernel vs onnxruntime's MatMulNBits (issue 27 lead)",
        "",
        "Written by `benchmarks/edge/int4_kernel/bench.py` (its docstring says what is measured; the kernel",
        "is `services/edge_worker/native/kq4.c`). One thread, 4-bit weights in blocks of 32 with zero",
        "points, int8 activations (MatMulNBits accuracy level 4); random weights of the edge model's shapes.",
        "Interleaved rounds, medians. A lead, not a target: the engine does not use this kernel yet.",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Host: {host['cpu']}, {host['cores']} cores (shared with other jobs); onnxruntime {host['onnxruntime']},",
        f"gcc {host['gcc']}. Load average (1, 5, 15 min): {report['load_average_start']} at the start,",
        f"{report['load_average_after_shapes']} after the per-shape rounds, {report['load_average_end']} at the end.",
        "",
        f"## Per matmul (us per call, medians of {report['rounds']} rounds)",
        "",
        "onnxruntime: a one-node graph through IOBinding, less the same call on a one-Relu graph (its empty",
        "run); kernel: a C loop, activation quantization included; via ctypes: one Python call per matmul.",
        "",
        "| K x N | M | onnxruntime run | empty run | onnxruntime net | kernel | kernel via ctypes | net / kernel |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["shapes"]:
        lines.append(
            f"| {r['K']} x {r['N']} | {r['M']} | {r['ort_us']:.2f} | {r['ort_empty_us']:.2f} | {r['ort_net_us']:.2f} | "
            f"{r['kernel_us']:.2f} | {r['kernel_ctypes_us']:.2f} | {r['speedup']:.2f}x |"
        )
    lines += [
        "",
        f"## A decode step's matmuls: {model['layers']} layers x 7, distinct weights (ms per step)",
        "",
        f"{model['matmuls']} matmuls, {model['weight_mb_matmulnbits']:.1f} MB of MatMulNBits weights "
        f"({model['weight_mb_kernel']:.1f} MB in the kernel's layout; L3 cache: {host['l3_cache']}).",
        "onnxruntime: one graph of all the MatMulNBits nodes, one run per step; kernel: the same matmuls in",
        f"a C loop. Medians of {model['rounds']} rounds of {model['reps']} steps (min..max of the rounds).",
        "",
        "| M | onnxruntime | kernel | onnxruntime / kernel | max abs diff vs onnxruntime |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in model["rows"]:
        lo, hi = r["ort_ms_range"]
        klo, khi = r["kernel_ms_range"]
        lines.append(
            f"| {r['M']} | {r['ort_ms']:.2f} ({lo:.2f}..{hi:.2f}) | {r['kernel_ms']:.2f} ({klo:.2f}..{khi:.2f}) | "
            f"{r['speedup']:.2f}x | {r['max_abs_diff_vs_ort']:.2e} |"
        )
    checks = report["checks"]
    compared = sum(c["rows_compared"] for c in checks)
    mismatches = sum(c["row_mismatches"] for c in checks)
    lines += [
        "",
        "## Checks",
        "",
        f"Row invariance, kernel: {compared} rows ({len(checks)} shapes x every M = 1..16 x every offset in 16 rows)",
        f"compared bitwise with the same row computed alone: **{mismatches} mismatches**.",
        "",
        f"Decode-step run, matmuls whose M rows differ from the first M rows of the M={model['top_m']} call: "
        + "; ".join(
            f"M={r['M']}: kernel {r['kernel_ops_rows_differing_vs_top']}, "
            f"onnxruntime {r['ort_ops_rows_differing_vs_top']}"
            for r in model["rows"]
            if r["M"] != model["top_m"]
        )
        + f" (of {model['matmuls']}).",
        "",
        "| K x N | onnxruntime rows of M=16 differing from the row alone | kernel vs onnxruntime, max abs "
        "| kernel vs numpy replica, max rel | kernel vs float, max abs | onnxruntime vs float, max abs "
        "| max abs output |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in checks:
        lines.append(
            f"| {c['K']} x {c['N']} | {c['ort_rows_differing_m16_vs_alone']}/16 "
            f"(max {c['ort_max_diff_m16_vs_alone']:.1e}) | "
            f"{c['max_abs_diff_vs_ort']:.1e} | {c['max_rel_vs_quantized_reference']:.1e} | "
            f"{c['max_abs_kernel_vs_float']:.1e} | {c['max_abs_ort_vs_float']:.1e} | {c['max_abs_output']:.1f} |"
        )
    lines += [
        "",
        "Reading: the kernel and onnxruntime compute the same quantized product but for the scales, which the",
        "kernel keeps in fp16 (each within 2^-11 of itself; the numpy replica uses the same fp16 scales, so the",
        "kernel matches it to fp32 rounding); both differences are far below the quantization error against the",
        "float product, which is the same for both.",
        "onnxruntime's single-row calls use another kernel than its multi-row ones (docs/edge.md, issue 27),",
        "so its rows change with M; the kernel's do not. Absolute times stretch on a loaded host; each ratio",
        "is between rounds interleaved under the same load.",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshserve bench edge-int4-kernel", description=__doc__.splitlines()[0])
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 2, 16], help="rows per call to time")
    parser.add_argument("--rounds", type=int, default=11, help="interleaved rounds of the per-shape timings")
    parser.add_argument("--batch-seconds", type=float, default=0.02, help="length of one timed batch of calls")
    parser.add_argument("--layers", type=int, default=30, help="decoder layers in the decode-step run")
    parser.add_argument("--model-rounds", type=int, default=15, help="interleaved rounds of the decode-step run")
    parser.add_argument("--model-reps", type=int, default=5, help="decode steps per round and implementation")
    parser.add_argument("--cache-dir", type=Path, default=None, help="where the compiled kernel is kept")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/edge_int4_kernel.md"))
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if min(args.ms) < 1 or args.rounds < 1 or args.layers < 1 or args.model_rounds < 1 or args.model_reps < 1:
        parser.error("--ms, --rounds, --layers, --model-rounds and --model-reps must be at least 1")
    try:
        kernel = load_kernel(args.cache_dir)
    except KernelUnavailable as e:
        print(f"edge-int4-kernel: {e}")
        return 2
    command = " ".join(["meshserve bench edge-int4-kernel", *argv])
    report: dict[str, Any] = {"command": command, "host": _host(), "kernel_library": kernel.path.name}
    report["load_average_start"] = load_average()
    print(f"load average {report['load_average_start']}; kernel {kernel.path}", flush=True)
    started = time.perf_counter()
    report["rounds"] = args.rounds
    report["shapes"], report["checks"] = measure_shapes(kernel, args.ms, args.rounds, args.batch_seconds)
    report["load_average_after_shapes"] = load_average()
    for r in report["shapes"]:
        print(
            f"{r['K']:5d} x {r['N']:5d} M={r['M']:2d}: onnxruntime net {r['ort_net_us']:8.2f} us, "
            f"kernel {r['kernel_us']:8.2f} us -> {r['speedup']:.2f}x",
            flush=True,
        )
    report["model"] = measure_model(kernel, args.ms, args.layers, args.model_rounds, args.model_reps)
    report["load_average_end"] = load_average()
    report["seconds"] = time.perf_counter() - started
    for r in report["model"]["rows"]:
        print(
            f"{args.layers} layers M={r['M']:2d}: onnxruntime {r['ort_ms']:.2f} ms, kernel {r['kernel_ms']:.2f} ms "
            f"-> {r['speedup']:.2f}x (max abs diff {r['max_abs_diff_vs_ort']:.1e})",
            flush=True,
        )
    mismatches = sum(c["row_mismatches"] for c in report["checks"]) + sum(
        r["kernel_ops_rows_differing_vs_top"] for r in report["model"]["rows"]
    )
    worst = max(c["max_rel_vs_quantized_reference"] for c in report["checks"])
    print(f"row invariance mismatches: {mismatches}; max rel vs numpy replica {worst:.1e}; "
          f"load average {report['load_average_end']}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown(report))
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    if mismatches or worst > MAX_REL_TO_REFERENCE:
        print("edge-int4-kernel: CHECK FAILED (row invariance or agreement with the numpy replica)")
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
