"""Edge tier: the worker's CPU time per token at 16 streams with ``top_logprobs=5`` vs without.

The batched edge engine in-process under the worker runtime itself (``services.worker.runner.Runner``:
its engine loop thread steps the engine, its output processing detokenizes, matches stop strings and,
with logprobs, adds the token texts and bytes), every event of every turn turned into the worker's
wire frame (``WorkerResponse``, serialised), so the number covers what asking costs the worker: the
sampler's log-softmax and top-k, the token texts and the bigger frames. Greedy decoding: both
variants produce the same tokens, so the batches are the same. CPU time is this process's (model
threads included); rounds alternate baseline and variant, and each number is the median over
``--repeats`` rounds.

``meshserve bench edge-logprobs`` (or ``python -m benchmarks.edge.logprobs``) prints
``TARGET per-token CPU with top_logprobs=5 vs without: +x.x % (target <= +5 %): PASS|FAIL`` and writes
docs/benchmarks/edge_logprobs.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from services.common import logprobs_pb
from services.common.generation import GenerationRequest
from services.common.model_paths import model_paths
from services.common.pb.meshserve.internal.v1 import worker_pb2
from services.common.sampling import SamplingParams
from services.edge_worker.ort_engine import OrtEngine
from services.worker.runner import Runner

PROMPT = (
    "<|im_start|>user\nTell me a long story about a lighthouse keeper and the sea.<|im_end|>\n<|im_start|>assistant\n"
)
TARGET_PCT = 5.0


async def _round(runner: Runner, prompt: tuple[int, ...], streams: int, sampling: SamplingParams) -> dict[str, float]:
    produced = [0] * streams
    frame_bytes = [0] * streams

    async def run(i: int) -> None:
        async for event in runner.turn(GenerationRequest(prompt, sampling)).events():
            if event.queued:
                continue
            frame = worker_pb2.WorkerResponse(sequence=event.sequence, token_ids=event.token_ids, text=event.text)
            if event.logprobs:
                frame.logprobs.extend(logprobs_pb.to_pb(event.logprobs))
            frame_bytes[i] += len(frame.SerializeToString())
            if event.final is not None:
                produced[i] = event.final.completion_tokens

    cpu, start = time.process_time(), time.perf_counter()
    await asyncio.gather(*(run(i) for i in range(streams)))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(produced)
    return {
        "tokens": tokens,
        "cpu_ms_per_token": 1000 * cpu / tokens,
        "aggregate_tokens_per_s": tokens / wall,
        "frame_bytes_per_token": sum(frame_bytes) / tokens,
    }


def measure(streams: int, max_tokens: int, repeats: int, threads: int, top: int) -> dict[str, Any]:
    edge_dir = model_paths().edge_dir
    engine = OrtEngine(edge_dir, model_id="bench", threads=threads, max_batch=max(2, streams))
    prompt = tuple(Tokenizer.from_file(str(edge_dir / "tokenizer.json")).encode(PROMPT).ids)
    variants = {
        "baseline": SamplingParams(max_tokens=max_tokens),
        f"top_logprobs={top}": SamplingParams(max_tokens=max_tokens, logprobs=True, top_logprobs=top),
    }

    async def run_rounds() -> dict[str, list[dict[str, float]]]:
        runner = Runner(engine, max_active=max(2, streams), max_queue=0)
        try:
            await _round(runner, prompt, 2, SamplingParams(max_tokens=4))  # warm-up
            samples: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
            for r in range(repeats):
                order = list(variants.items()) if r % 2 == 0 else list(reversed(variants.items()))
                for name, sampling in order:  # alternated: both see the same load
                    samples[name].append(await _round(runner, prompt, streams, sampling))
            return samples
        finally:
            await runner.aclose()

    try:
        samples = asyncio.run(run_rounds())
    finally:
        engine.close()
    out: dict[str, Any] = {}
    for name, rounds in samples.items():
        out[name] = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        out[name]["rounds_cpu_ms_per_token"] = [round(r["cpu_ms_per_token"], 3) for r in rounds]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshserve bench edge-logprobs", description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16, help="concurrent streams (default 16)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per stream (default 48)")
    parser.add_argument("--repeats", type=int, default=4, help="rounds per variant, alternated (median; default 4)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="onnxruntime intra-op threads")
    parser.add_argument("--top-logprobs", type=int, default=5, help="top_logprobs of the variant (default 5)")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"), help="output directory")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    began = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = measure(args.streams, args.max_tokens, args.repeats, args.threads, args.top_logprobs)
    load_after = os.getloadavg()
    base, variant = results["baseline"], results[f"top_logprobs={args.top_logprobs}"]
    extra = 100 * (variant["cpu_ms_per_token"] / base["cpu_ms_per_token"] - 1)
    verdict = "PASS" if extra <= TARGET_PCT else "FAIL"
    target = (
        f"TARGET per-token CPU with top_logprobs={args.top_logprobs} vs without at {args.streams} streams: "
        f"{extra:+.1f} % (target <= +{TARGET_PCT:g} %): {verdict}"
    )
    report = {
        "date": began,
        "command": "meshserve bench edge-logprobs " + " ".join(argv if argv is not None else sys.argv[1:]),
        "started": began,
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "threads": args.threads,
        "cpus": os.cpu_count(),
        "load_avg_1m_before": load_before[0],
        "load_avg_1m_after": load_after[0],
        "results": results,
        "cpu_overhead_pct": extra,
        "target": target,
    }
    print(target)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "edge_logprobs.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Edge tier: logprobs cost (`meshserve bench edge-logprobs`)",
        "",
        f"{began}; {args.streams} streams x {args.max_tokens} greedy tokens, {args.repeats} alternated rounds per "
        f"variant (medians), {args.threads} intra-op threads on {os.cpu_count()} CPUs; load average (1 min) "
        f"{load_before[0]:.2f} before, {load_after[0]:.2f} after. Method: benchmarks/edge/logprobs.py.",
        "",
        "| variant | worker CPU ms/token | aggregate tok/s | frame bytes/token | CPU ms/token per round |",
        "|---|---:|---:|---:|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['cpu_ms_per_token']:.3f} | {r['aggregate_tokens_per_s']:.1f} | "
            f"{r['frame_bytes_per_token']:.0f} | {', '.join(map(str, r['rounds_cpu_ms_per_token']))} |"
        )
    lines += ["", "```", target, "```", ""]
    (args.out / "edge_logprobs.md").write_text("\n".join(lines))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
