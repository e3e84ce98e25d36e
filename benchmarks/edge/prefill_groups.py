"""Several new prompts at once on the edge tier: one prefill call for prompts of one length vs one each.

The batched engine (the real INT4 model, in this process) gets ``--streams`` requests of the same
prompt length at once, in rounds that alternate between prefill grouping on (the default: new prompts
whose first chunks have the same length share a call, ``OrtEngine.group_prefill``) and off (one
sequence per prefill call, as before). Measured per round: each stream's time to its first token (p50
and max) and the round's wall time. The tokens are the same both ways (tested in
tests/integration/edge_worker/test_ort_engine.py). No target: a measurement.

``meshserve bench edge-prefill [--streams 16] [--max-tokens 8] [--repeats 6]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.engine_stepper import EngineStepper
from services.common.sampling import SamplingParams
from services.edge_worker.config import EdgeWorkerSettings
from services.edge_worker.ort_engine import OrtEngine

PROMPT = (
    "<|im_start|>user\nWrite a short story about a lighthouse keeper who finds a message in a bottle, "
    "and what she does next.<|im_end|>\n<|im_start|>assistant\n"
)


def _round(engine: OrtEngine, prompt: list[int], streams: int, max_tokens: int) -> dict[str, float]:
    """The streams added at once and stepped to their end in this thread (the engine loop's way)."""
    stepper = EngineStepper(engine)
    calls, start = engine.prefill_calls, time.perf_counter()
    for _ in range(streams):
        stepper.add(prompt, SamplingParams(max_tokens=max_tokens))
    first = [stream.stamps[0] - start for stream in stepper.run(raise_errors=True).values()]
    return {
        "ttft_p50_ms": 1000 * statistics.median(first),
        "ttft_max_ms": 1000 * max(first),
        "round_s": time.perf_counter() - start,
        "prefill_calls": engine.prefill_calls - calls,
    }


def measure(*, streams: int, max_tokens: int, repeats: int, threads: int) -> dict[str, Any]:
    settings = EdgeWorkerSettings()
    engine = OrtEngine(settings.resolved_model_dir(), model_id="bench", threads=threads, max_batch=streams)
    try:
        prompt = list(engine.tokenizer.encode(PROMPT).ids)
        rounds: dict[str, list[dict[str, float]]] = {"grouped": [], "one per call": []}
        _round(engine, prompt, streams, max_tokens)  # warm-up
        for _ in range(repeats):
            for name, grouped in (("grouped", True), ("one per call", False)):
                engine.group_prefill = grouped
                rounds[name].append(_round(engine, prompt, streams, max_tokens))
    finally:
        engine.close()
    medians = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in rounds.items()}
    wins = sum(
        g["ttft_p50_ms"] < o["ttft_p50_ms"] for g, o in zip(rounds["grouped"], rounds["one per call"], strict=True)
    )
    return {
        "streams": streams,
        "prompt_tokens": len(prompt),
        "max_tokens": max_tokens,
        "repeats": repeats,
        "medians": medians,
        "grouped_faster_rounds": wins,
        "rounds": rounds,
    }


def markdown(result: dict[str, Any], command: str, load: str) -> str:
    lines = [
        "# Edge tier: several new prompts in one prefill call",
        "",
        f"`{command}`; load average at the start {load}. {result['streams']} requests of "
        f"{result['prompt_tokens']} prompt tokens at once, {result['max_tokens']} tokens each, in-process batched "
        f"engine; medians of {result['repeats']} interleaved rounds per mode.",
        "",
        "| mode | prefill calls | TTFT p50 (ms) | TTFT max (ms) | round (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, m in result["medians"].items():
        lines.append(
            f"| {name} | {m['prefill_calls']:.0f} | {m['ttft_p50_ms']:.0f} | {m['ttft_max_ms']:.0f} | "
            f"{m['round_s']:.2f} |"
        )
    wins = f"Grouped TTFT p50 lower in {result['grouped_faster_rounds']} of {result['repeats']} paired rounds."
    lines += ["", wins, ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshserve bench edge-prefill", description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/edge_prefill.md"))
    args = parser.parse_args(argv)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    result = measure(streams=args.streams, max_tokens=args.max_tokens, repeats=args.repeats, threads=args.threads)
    command = " ".join(["meshserve bench edge-prefill", *(argv if argv is not None else [])])
    text = markdown(result, command, load)
    print(text)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"load_average": load, **result}, indent=1) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
