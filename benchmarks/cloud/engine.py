"""Cloud engine benchmark: batched throughput vs transformers, and TTFT with prefix KV reuse.

``meshserve bench --only cloud`` (or ``python -m benchmarks.cloud.engine``). In one process, with the same
prompts for every contender:

1. Throughput at 1, 4 and 16 concurrent streams: our CloudEngine (every stream added at once and
   stepped together, as the worker's engine loop runs them: driver.py) vs transformers' sequential
   ``generate`` (one prompt after another)
   vs transformers' ``generate_batch`` (its continuous batching; manager kept warm, set-up not
   timed). Greedy, the same ``max_tokens``; tokens counted as generated (EOS may end one early).
   Rounds interleave the contenders so load drift hits them alike; medians are reported with the
   CPU seconds each generated token cost this process (robust to other load on the machine).
2. TTFT of a ~1k-token prompt (a document + a question): cold; the same document with another
   question on the same replica (local prefix blocks); and on a second replica that never saw it
   (prefix imported from Redis, exported by the first). A fresh document per round keeps "cold"
   cold.

Writes docs/benchmarks/cloud.json and cloud.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.cache.bench import start_redis
from benchmarks.engine_stepper import EngineStepper
from services.common.model_paths import model_paths
from services.common.sampling import SamplingParams
from services.gpu_worker.engine import CloudEngine
from services.gpu_worker.prefix import RedisPrefixCache

TOPICS = [
    "the water cycle", "how bread rises", "why the sky is blue", "the history of the printing press",
    "how vaccines work", "the rules of chess", "photosynthesis", "how a bicycle stays upright",
    "the causes of tides", "how compilers work", "the life of honey bees", "volcanoes",
    "how money is created", "the first moon landing", "how rainbows form", "the invention of the telephone",
]  # fmt: skip
PROMPTS = [f"<|im_start|>user\nExplain {t} in a short paragraph.<|im_end|>\n<|im_start|>assistant\n" for t in TOPICS]
DOC = (
    "The river valley has been settled for thousands of years. Farmers grew wheat and barley on its "
    "terraces, traders carried salt and wool along its banks, and each town built a bridge, a market "
    "and a church of its own. Floods came every few decades and reshaped the fields. "
)
QUESTIONS = ["What did the farmers grow?", "What did traders carry?", "What did each town build?"]


def _rss_load() -> float:
    return os.getloadavg()[0]


class Timer:
    """Wall and process CPU time of a block."""

    def __enter__(self) -> Timer:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu


def ours(engine: CloudEngine, prompts: list[list[int]], n: int) -> tuple[int, Timer]:
    with Timer() as t:
        stepper = EngineStepper(engine)
        ids = [stepper.add(p, SamplingParams(max_tokens=n)) for p in prompts]
        done = stepper.run(ids, raise_errors=True)
    return sum(len(done[i].tokens) for i in ids), t


def hf_sequential(model: Any, prompts: list[list[int]], n: int) -> tuple[int, Timer]:
    total = 0
    with Timer() as t, torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n)
            total += out.shape[1] - len(ids)
    return total, t


def hf_generate_batch(model: Any, prompts: list[list[int]], n: int) -> tuple[int, Timer]:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=model.generation_config.eos_token_id)
    cb = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=512)
    with Timer() as t, torch.inference_mode():
        out = model.generate_batch(
            prompts, generation_config=config, continuous_batching_config=cb, persistent_manager=True, warmup=False
        )
    return sum(len(o.generated_tokens) for o in out.values()), t


def throughput(engine: CloudEngine, model: Any, prompts: list[list[int]], n: int, rounds: int) -> dict[str, Any]:
    contenders: dict[str, Callable[[list[list[int]]], tuple[int, Timer]]] = {
        "ours": lambda p: ours(engine, p, n),
        "hf_generate": lambda p: hf_sequential(model, p, n),
        "hf_generate_batch": lambda p: hf_generate_batch(model, p, n),
    }
    hf_generate_batch(model, prompts[:2], 2)  # builds the persistent manager (not timed)
    ours(engine, prompts[:2], 2)
    results: dict[str, Any] = {}
    for streams in (1, 4, 16):
        samples: dict[str, list[tuple[float, float]]] = {k: [] for k in contenders}
        for r in range(rounds):
            for name, run in contenders.items():
                print(f"\rthroughput: {streams} streams, round {r + 1}/{rounds}, {name}   ", end="", file=sys.stderr)
                tokens, t = run(prompts[:streams])
                samples[name].append((tokens / t.wall, t.cpu / tokens))
        results[str(streams)] = {
            name: {
                "tokens_per_s": statistics.median(s[0] for s in v),
                "cpu_ms_per_token": 1000 * statistics.median(s[1] for s in v),
            }
            for name, v in samples.items()
        }
        print(file=sys.stderr)
    return results


def ttft(engine: CloudEngine, ids: list[int]) -> tuple[float, int]:
    """Seconds to the first token of ``ids`` alone (a Redis prefix load included), and the prompt
    tokens it prefilled."""
    stepper = EngineStepper(engine)
    seq = stepper.add(ids, SamplingParams(max_tokens=1))
    stream = stepper.run([seq], raise_errors=True)[seq]
    assert stream.prefill_tokens is not None
    return stream.ttft, stream.prefill_tokens


def prefix_ttft(a: CloudEngine, b: CloudEngine, encode: Callable[[str], list[int]], rounds: int) -> dict[str, Any]:
    rows: dict[str, list[tuple[float, int]]] = {"cold": [], "local_prefix": [], "redis_prefix_other_replica": []}
    prompt_tokens = 0
    for r in range(rounds):
        print(f"\rttft: round {r + 1}/{rounds}   ", end="", file=sys.stderr)
        doc = f"Document {time.time_ns()}.\n" + DOC * 17  # a new document: nothing cached anywhere
        prompts = [encode(f"<|im_start|>user\n{doc}\n{q}<|im_end|>\n<|im_start|>assistant\n") for q in QUESTIONS]
        prompt_tokens = len(prompts[0])
        rows["cold"].append(ttft(a, prompts[0]))
        assert a.redis is not None
        a.redis.flush()  # the export of the finished prefix has reached Redis
        rows["local_prefix"].append(ttft(a, prompts[1]))
        rows["redis_prefix_other_replica"].append(ttft(b, prompts[2]))
    print(file=sys.stderr)
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens}
    for name, v in rows.items():
        out[name] = {"ttft_ms_p50": 1000 * statistics.median(x[0] for x in v), "prefilled_tokens": v[-1][1]}
    cold = out["cold"]["ttft_ms_p50"]
    for name in ("local_prefix", "redis_prefix_other_replica"):
        out[name]["speedup_vs_cold"] = cold / out[name]["ttft_ms_p50"]
    return out


def _engine(redis_url: str, threads: int) -> CloudEngine:
    redis = RedisPrefixCache(
        redis_url, block_tokens=16, budget_bytes=1 << 30, ttl_s=600, timeout_s=2.0, max_block_bytes=64 << 20
    )
    return CloudEngine(
        str(model_paths().hf_dir),
        model_id="smollm2-135m-instruct",
        model_version=model_paths().version(),
        device="cpu",
        threads=threads,
        kv_budget_bytes=1 << 30,
        redis=redis,
    )


def run(max_tokens: int, rounds: int, ttft_rounds: int, threads: int) -> dict[str, Any]:
    import logging

    from transformers import AutoModelForCausalLM

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)  # one warning per call otherwise

    load_before = _rss_load()
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_redis(tmp)
        try:
            a, b = _engine(url, threads), _engine(url, threads)
            hf = AutoModelForCausalLM.from_pretrained(str(model_paths().hf_dir), dtype=torch.float32).eval()

            def encode(text: str) -> list[int]:
                return list(a.tokenizer.encode(text).ids)

            prompts = [encode(p) for p in PROMPTS]
            prefix = prefix_ttft(a, b, encode, ttft_rounds)
            tput = throughput(a, hf, prompts, max_tokens, rounds)
            a.close()
            b.close()
        finally:
            proc.terminate()
            proc.wait()
    return {
        "benchmark": "cloud",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "load_avg_1m_before": round(load_before, 2),
            "load_avg_1m_after": round(_rss_load(), 2),
        },
        "command": f"meshserve bench --only cloud --max-tokens {max_tokens} --rounds {rounds} --threads {threads}",
        "device": "cpu",
        "threads": threads,
        "max_tokens": max_tokens,
        "prompt_tokens": [len(p) for p in prompts],
        "throughput": tput,
        "prefix_ttft": prefix,
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Cloud engine: continuous batching and prefix KV reuse (CPU)",
        "",
        f"Measured {report['date']} on {report['machine']} with `{report['command']}`.",
        f"torch threads: {report['threads']}. Greedy, up to {report['max_tokens']} new tokens per prompt, the same "
        "16 chat prompts for every contender; medians over the rounds (contenders interleaved).",
        "",
        "## Throughput (tokens/s, all streams together; CPU ms per generated token in brackets)",
        "",
        "| streams | ours | transformers `generate` (sequential) | transformers `generate_batch` "
        "| ours / generate_batch |",
        "|---:|---:|---:|---:|---:|",
    ]
    for streams, row in report["throughput"].items():
        o, g, gb = row["ours"], row["hf_generate"], row["hf_generate_batch"]
        lines.append(
            f"| {streams} | {o['tokens_per_s']:.1f} ({o['cpu_ms_per_token']:.1f}) | {g['tokens_per_s']:.1f} "
            f"({g['cpu_ms_per_token']:.1f}) | {gb['tokens_per_s']:.1f} ({gb['cpu_ms_per_token']:.1f}) | "
            f"**{o['tokens_per_s'] / gb['tokens_per_s']:.2f}x** |"
        )
    p = report["prefix_ttft"]
    lines += [
        "",
        f"## TTFT of a {p['prompt_tokens']}-token prompt (document + question)",
        "",
        "| case | TTFT p50 (ms) | prompt tokens prefilled | speed-up vs cold |",
        "|---|---:|---:|---:|",
    ]
    for name in ("cold", "local_prefix", "redis_prefix_other_replica"):
        row = p[name]
        speed = f"**{row['speedup_vs_cold']:.1f}x**" if "speedup_vs_cold" in row else "1x"
        lines.append(f"| {name} | {row['ttft_ms_p50']:.1f} | {row['prefilled_tokens']} | {speed} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshserve bench --only cloud", description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per prompt (default 32)")
    parser.add_argument("--rounds", type=int, default=2, help="throughput rounds per contender (default 2)")
    parser.add_argument("--ttft-rounds", type=int, default=5, help="TTFT rounds (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"), help="output directory")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    report = run(args.max_tokens, args.rounds, args.ttft_rounds, args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cloud.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "cloud.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
