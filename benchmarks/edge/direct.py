"""The edge engine in-process (no mesh): aggregate tokens/s and CPU time per token at N streams.

The streams are added at once and the engine is stepped back to back in this thread, as the worker's
engine loop steps it (:mod:`benchmarks.engine_stepper`; no runtime: no detokenizing, no frames); a stream
ends at its ``max_tokens`` or at EOS. CPU time is this process's (model threads included), so it is less
sensitive than wall time to other jobs on a shared machine. Rounds of the engines compared are
interleaved, and each number is the median over ``repeats`` rounds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.engine_stepper import EngineStepper
from services.common.sampling import SamplingParams
from services.worker.types import Engine


def load_engine(kind: str, model_dir: Path, threads: int, max_batch: int) -> Engine:
    if kind == "og":
        from services.edge_worker.og_engine import OgEngine

        return OgEngine(model_dir, model_id="bench", threads=threads)
    from services.edge_worker.ort_engine import OrtEngine

    # Variants, joined with '-': "batched-1row": a lone sequence decodes in one row
    # (MESHSERVE_EDGE_WORKER_BATCH_INVARIANT=false); "batched-nbitshead": the LM head as built
    # (LM_HEAD=nbits); "batched-spin": intra-op threads spin (INTRA_OP_SPINNING=true, the worker's default,
    # which every variant but adaptive follows, with its INTRA_OP_SPIN_US); "batched-adaptive":
    # 2 threads sleeping / spinning or 1 thread, per small call by measured time (ADAPTIVE_THREADING=true);
    # "batched-native": the 4-bit matmuls on our row-invariant kernel, a lone sequence in one row
    # (INT4_KERNEL=native).
    base, *variants = kind.split("-")
    unknown = set(variants) - {"1row", "nbitshead", "spin", "adaptive", "native"}
    if base != "batched" or unknown:
        raise ValueError(f"unknown engine kind {kind!r}")
    from services.common.config import load_settings
    from services.edge_worker.config import EdgeWorkerSettings

    worker = load_settings(EdgeWorkerSettings)  # the worker's spinning (its environment's), as in the mesh
    return OrtEngine(
        model_dir,
        model_id="bench",
        threads=threads,
        max_batch=max_batch,
        batch_invariant="1row" not in variants,
        lm_head="nbits" if "nbitshead" in variants else "int8",
        spinning="spin" in variants or (worker.intra_op_spinning and "adaptive" not in variants),
        spin_us=worker.intra_op_spin_us,
        adaptive_threading="adaptive" in variants,
        int4_kernel="native" if "native" in variants else "mlas",
    )


def _round(engine: Engine, prompt: list[int], streams: int, max_tokens: int) -> dict[str, float]:
    stepper = EngineStepper(engine)
    cpu, start = time.process_time(), time.perf_counter()
    for _ in range(streams):
        stepper.add(prompt, SamplingParams(max_tokens=max_tokens))
    stamps = [stream.stamps for stream in stepper.run(raise_errors=True).values()]
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(s) for s in stamps)
    decode = [(len(s) - 1) / (s[-1] - s[0]) for s in stamps if len(s) > 1 and s[-1] > s[0]]
    return {
        "aggregate_tokens_per_s": tokens / wall,
        "cpu_ms_per_token": 1000 * cpu / tokens,
        "decode_tokens_per_s_per_stream": statistics.median(decode) if decode else 0.0,
    }


def measure(
    kinds: Sequence[str],
    model_dir: Path,
    prompt: list[int],
    *,
    threads: int,
    counts: Sequence[int],
    max_tokens: int,
    repeats: int,
) -> dict[str, list[dict[str, Any]]]:
    """``{kind: [{streams, aggregate_tokens_per_s, cpu_ms_per_token, ...}, ...]}`` (medians)."""
    engines = {kind: load_engine(kind, model_dir, threads, max(counts)) for kind in kinds}
    for engine in engines.values():
        _round(engine, prompt, 1, 4)  # warm-up
    samples: dict[tuple[str, int], list[dict[str, float]]] = {}
    for _ in range(repeats):
        for n in counts:
            for kind, engine in engines.items():  # interleaved: both engines see the same load
                samples.setdefault((kind, n), []).append(_round(engine, prompt, n, max_tokens))
    out: dict[str, list[dict[str, Any]]] = {}
    for (kind, n), rounds in samples.items():
        row: dict[str, Any] = {"streams": n, "repeats": len(rounds)}
        for key in rounds[0]:
            row[key] = statistics.median(r[key] for r in rounds)
        out.setdefault(kind, []).append(row)
    for engine in engines.values():
        engine.close()
    return out


def markdown(direct: dict[str, list[dict[str, Any]]], roofline: float) -> list[str]:
    lines = [
        "",
        "## The engine alone (in-process, no mesh; medians of interleaved rounds)",
        "",
        "| engine | streams | aggregate tok/s | x its single stream | CPU ms/token | decode tok/s per stream |"
        " single stream vs roofline |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, rows in direct.items():
        base = rows[0]["aggregate_tokens_per_s"] or float("nan")
        for r in rows:
            share = f"{100 * r['decode_tokens_per_s_per_stream'] / roofline:.0f} %" if r["streams"] == 1 else ""
            lines.append(
                f"| {kind} | {r['streams']} | {r['aggregate_tokens_per_s']:.1f} | "
                f"{r['aggregate_tokens_per_s'] / base:.2f} | {r['cpu_ms_per_token']:.1f} | "
                f"{r['decode_tokens_per_s_per_stream']:.1f} | {share} |"
            )
    return lines
