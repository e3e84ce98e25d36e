"""Structured output on the edge tier: CPU time per token at N streams with a JSON-schema constraint vs without.

The batched edge engine in-process (as :mod:`benchmarks.edge.direct`: the streams added at once and
stepped back to back in this thread, as the worker's engine loop steps them; each stream's grammar
state opened as the runtime opens it; CPU time is this process's, model threads included, so it is
less sensitive than wall time to other jobs on a shared host). Rounds of the two variants are
interleaved on one engine and each number is the median over ``--repeats`` rounds. The schema keeps
every stream inside a JSON string for the whole run (``minLength``), where the mask allows most of the
vocabulary: the mask is computed every step, nothing ends early. Writes
docs/benchmarks/edge_structured.{json,md} and prints the TARGET line (per-token CPU <= +15 %).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.engine_stepper import EngineStepper
from services.common.constraints import json_schema_constraint
from services.common.model_paths import model_paths
from services.common.sampling import SamplingParams

TARGET_OVERHEAD = 0.15
PROMPT = "<|im_start|>user\nWrite a long blog post about the sea as JSON.<|im_end|>\n<|im_start|>assistant\n"
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"enum": ["sea", "ocean", "travel", "nature"]}, "maxItems": 3},
        "body": {"type": "string", "minLength": 2000},
    },
    "required": ["title", "tags", "body"],
    "additionalProperties": False,
}


def _round(engine: Any, grammars: Any, prompt: list[int], streams: int, sampling: SamplingParams) -> dict[str, float]:
    stepper = EngineStepper(engine, grammars=grammars)  # the constraints compiled once, opened per stream
    cpu, start = time.process_time(), time.perf_counter()
    for _ in range(streams):
        stepper.add(prompt, sampling)  # its grammar state opened as the runtime opens it
    tokens = sum(len(stream.tokens) for stream in stepper.run(raise_errors=True).values())
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"cpu_ms_per_token": 1000 * cpu / tokens, "aggregate_tokens_per_s": tokens / wall, "tokens": tokens}


def measure(streams: int, max_tokens: int, repeats: int, threads: int) -> dict[str, Any]:
    from services.edge_worker.ort_engine import OrtEngine
    from services.worker.grammar import GrammarCompiler

    edge_dir = model_paths().edge_dir
    engine = OrtEngine(edge_dir, model_id="bench", threads=threads, max_batch=streams)
    info = engine.info
    grammars = GrammarCompiler(engine.tokenizer, info.vocab_size, info.eos_token_ids)  # the runtime's compiler
    try:
        prompt = list(engine.tokenizer.encode(PROMPT).ids)
        plain = SamplingParams(max_tokens=max_tokens)
        constrained = SamplingParams(max_tokens=max_tokens, structured=json_schema_constraint(SCHEMA))
        began = time.perf_counter()
        grammars.compiled(constrained.structured)  # type: ignore[arg-type]
        compile_ms = 1000 * (time.perf_counter() - began)  # the llguidance tokenizer included (once per engine)
        _round(engine, grammars, prompt, 2, SamplingParams(max_tokens=4))  # warm-up
        _round(engine, grammars, prompt, 2, constrained)
        samples: dict[str, list[dict[str, float]]] = {"plain": [], "json_schema": []}
        for _ in range(repeats):
            samples["plain"].append(_round(engine, grammars, prompt, streams, plain))
            samples["json_schema"].append(_round(engine, grammars, prompt, streams, constrained))
    finally:
        grammars.close()
        engine.close()
    out: dict[str, Any] = {
        "streams": streams,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "threads": threads,
        "first_compile_ms": round(compile_ms, 1),
        "load_avg_1m": os.getloadavg()[0],
        "cpus": os.cpu_count(),
    }
    for name, rounds in samples.items():
        out[name] = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        out[name]["rounds_cpu_ms_per_token"] = [round(r["cpu_ms_per_token"], 3) for r in rounds]
        out[name]["rounds_tokens_per_s"] = [round(r["aggregate_tokens_per_s"], 2) for r in rounds]
    out["overhead"] = out["json_schema"]["cpu_ms_per_token"] / out["plain"]["cpu_ms_per_token"] - 1
    return out


def target(report: dict[str, Any]) -> str:
    overhead = report["overhead"]
    verdict = "PASS" if overhead <= TARGET_OVERHEAD else "FAIL"
    return (
        f"TARGET edge per-token CPU with a JSON-schema constraint vs without at {report['streams']} streams: "
        f"{100 * overhead:+.1f} % (target <= +{100 * TARGET_OVERHEAD:.0f} %): {verdict}"
    )


def markdown(report: dict[str, Any], command: str) -> str:
    lines = [
        "# Edge tier: structured output (JSON schema) vs plain decoding",
        "",
        f"`{command}`: the batched edge engine in-process, {report['streams']} streams of {report['max_tokens']} "
        f"tokens, {report['threads']} intra-op threads, medians of {report['repeats']} interleaved rounds; host "
        f"load average (1 min) {report['load_avg_1m']:.2f} on {report['cpus']} CPUs at the end of the run.",
        "",
        "| variant | CPU ms/token | aggregate tok/s | CPU ms/token per round | tok/s per round |",
        "|---|---:|---:|---|---|",
    ]
    for name in ("plain", "json_schema"):
        r = report[name]
        rounds = ", ".join(f"{x:.2f}" for x in r["rounds_cpu_ms_per_token"])
        walls = ", ".join(f"{x:.1f}" for x in r.get("rounds_tokens_per_s", []))
        lines.append(
            f"| {name} | {r['cpu_ms_per_token']:.2f} | {r['aggregate_tokens_per_s']:.1f} | {rounds} | {walls} |"
        )
    lines += [
        "",
        "CPU time per token is the target's measure (this process's, model threads included). Aggregate tok/s is"
        " wall-clock: on a host loaded by other jobs it moves with their load between rounds, so compare it only"
        " on an idle host.",
        "",
        "First compile of the schema (with llguidance's tokenizer, built once per engine): "
        f"{report['first_compile_ms']:.0f} ms.",
        "",
        target(report),
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshserve bench edge-structured", description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16, help="concurrent streams (default 16)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per stream (default 48)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds per variant (median; default 3)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="intra-op threads")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"), help="output directory")
    args = parser.parse_args(argv)
    report = measure(args.streams, args.max_tokens, args.repeats, args.threads)
    command = "meshserve bench edge-structured " + " ".join(argv if argv is not None else sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "edge_structured.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report, command.strip())
    (args.out / "edge_structured.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
