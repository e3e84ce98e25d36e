"""Cloud engine on a GPU: issue 22's targets (default), or the engine report of the real model.

``python -m benchmarks.cloud.gpu [--device cuda] [--shapes 135m 1b]``: the targets run of
cloud_gpu_targets.py (anchors, engine, roofline shares, parity checks, gRPC rows; ``TARGET`` lines into
docs/benchmarks/cloud_gpu.md); ``--device cpu --tiny`` is its smoke mode (seconds).

``python -m benchmarks.cloud.gpu --engine-report [--model DIR] [--device cuda]`` (also runs with
``--device cpu``): the report below of the prepared SmolLM2 checkpoint. Everything goes through the
gpu_worker's own ``CloudEngine`` (its default dtype: bfloat16 on CUDA):

1. Parity: each prompt's greedy tokens from the engine on ``--device`` vs the same engine on the CPU
   in float32 (first differing position), and teacher-forced top-1 agreement of the two models'
   logits along the CPU's tokens (with the CPU's top-1/top-2 margin where they first disagree).
2. Batching invariance on ``--device``: the same prompts alone, joined one by one while the others
   decode (the integration test's pattern), and all at once in a batch of 8 and 32; every run must
   give the tokens the prompt gets alone. Plus cancel frees KV at once, a request beyond the KV
   budget is RESOURCE_EXHAUSTED, and a repeated prompt reuses its local prefix blocks.

The engine is stepped in this thread as the worker's engine loop steps it (driver.py: add, step,
stop), without the worker runtime around it.
3. Throughput: single-stream decode tokens/s, aggregate tokens/s at 1/8/32 concurrent sequences
   (EOS ignored, so every sequence decodes exactly ``--bench-tokens``), and the prefill of a
   512-token prompt (time to first token through the engine, and one bare model forward).

Writes ``cloud_gpu.json`` and ``cloud_gpu.md`` to ``--out`` (default docs/benchmarks).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.cloud import gpu_targets as cloud_gpu_targets
from benchmarks.engine_stepper import EngineStepper
from services.common.errors import ResourceExhausted
from services.common.model_paths import model_paths
from services.common.sampling import SamplingParams
from services.gpu_worker.engine import CloudEngine
from services.gpu_worker.plan import Segment

TOPICS = [
    "the water cycle", "how bread rises", "why the sky is blue", "the printing press", "how vaccines work",
    "the rules of chess", "photosynthesis", "how a bicycle stays upright", "the causes of tides",
    "how compilers work", "honey bees", "volcanoes", "how money is created", "the first moon landing",
    "how rainbows form", "the telephone",
]  # fmt: skip
CHAT = [f"<|im_start|>user\nExplain {t} in a short paragraph.<|im_end|>\n<|im_start|>assistant\n" for t in TOPICS]
STORY = "The history of the river valley and the towns along it is long and full of change. "
PARITY_PROMPTS = [*CHAT[:3], "The capital of France is", STORY * 6, "def fibonacci(n):"]


def engine(model: str, device: str, **kw: Any) -> CloudEngine:
    options: dict[str, Any] = dict(model_id="smollm2-135m-instruct", model_version="gpu-bench", device=device)
    options.update(kw)
    return CloudEngine(model, **options)


def generate(e: CloudEngine, ids: list[int], n: int, sampling: SamplingParams | None = None) -> list[int]:
    """Up to ``n`` tokens of ``ids`` alone (an EOS included)."""
    return EngineStepper(e).generate(ids, sampling or SamplingParams(max_tokens=n))


def concurrent(e: CloudEngine, prompts: list[list[int]], n: int, staggered: bool = False) -> list[list[int]]:
    """Every prompt in one batch (as the worker's engine loop runs them); ``staggered``: each is added
    once the one before it decodes (it joins a running batch)."""
    stepper = EngineStepper(e)
    ids = []
    for p in prompts:
        ids.append(stepper.add(p, SamplingParams(max_tokens=n)))
        if staggered:
            stepper.run_until(ids[-1])
    streams = stepper.run(ids, raise_errors=True)
    return [streams[i].tokens for i in ids]


def first_diff(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def teacher_forced(e: CloudEngine, ref: CloudEngine, prompt: list[int], tokens: list[int]) -> dict[str, Any]:
    """Top-1 agreement of the two models' logits along ``prompt + tokens`` (positions predicting ``tokens``)."""
    ids = prompt + tokens
    rows = []
    for m in (e.model, ref.model):
        blocks = (len(ids) + 15) // 16
        cache = m.new_cache(blocks, 16, m.dtype)
        logits = m.forward([Segment(ids, 0, list(range(blocks)), all_logits=True)], cache)[0]
        rows.append(logits[len(prompt) - 1 : len(ids) - 1].float().cpu())
    got, want = rows
    agree = got.argmax(-1) == want.argmax(-1)
    out: dict[str, Any] = {
        "positions": len(tokens),
        "top1_agreement": float(agree.float().mean()),
        "max_abs_logit_diff": float((got - want).abs().max()),
    }
    bad = (~agree).nonzero().flatten().tolist()
    if bad:
        top2 = want[bad[0]].topk(2).values
        out["first_disagreement"] = bad[0]
        out["ref_top1_top2_margin_there"] = float(top2[0] - top2[1])
    return out


def parity(e: CloudEngine, ref: CloudEngine, n: int) -> list[dict[str, Any]]:
    rows = []
    for text in PARITY_PROMPTS:
        ids = list(e.tokenizer.encode(text).ids)
        got, want = generate(e, ids, n), generate(ref, ids, n)
        diff = first_diff(got, want)
        row = {"prompt": text[:48], "prompt_tokens": len(ids), "tokens": len(want), "first_diff": diff}
        row["equal_prefix"] = len(want) if diff is None else diff
        row["teacher_forced"] = teacher_forced(e, ref, ids, want)
        if diff is not None:
            row["device_text_at_diff"] = e.tokenizer.decode(got[max(0, diff - 4) : diff + 6])
            row["cpu_text_at_diff"] = e.tokenizer.decode(want[max(0, diff - 4) : diff + 6])
        rows.append(row)
    return rows


def invariance(e: CloudEngine, n: int) -> dict[str, Any]:
    four = [list(e.tokenizer.encode(t).ids) for t in (CHAT[0], "The capital of France is", STORY * 6, "def f(n):")]
    many = [list(e.tokenizer.encode(t).ids) for t in CHAT * 2]  # 32 prompts (16 distinct)
    alone = {tuple(p): generate(e, p, n) for p in four + many[:16]}
    out: dict[str, Any] = {}
    for name, prompts, staggered in (
        ("staggered_4", four, True),
        ("batch_8", many[:8], False),
        ("batch_32", many, False),
    ):
        results = concurrent(e, prompts, n, staggered)
        diffs = [first_diff(r, alone[tuple(p)]) for r, p in zip(results, prompts, strict=True)]
        out[name] = {
            "sequences": len(prompts),
            "equal_to_alone": sum(d is None for d in diffs),
            "first_diffs": [d for d in diffs if d is not None],
        }
    out["kv_used_after"] = e.kv_usage().used_bytes
    return out


def engine_checks(e: CloudEngine) -> dict[str, Any]:
    ids = list(e.tokenizer.encode(STORY * 8).ids)
    stepper = EngineStepper(e)
    seq = stepper.add(ids, SamplingParams(max_tokens=200))
    stepper.run_until(seq, 2)
    held = e.kv_usage().used_bytes
    stepper.stop(seq)
    checks: dict[str, Any] = {"cancel_kv_held_before": held, "cancel_kv_used_after": e.kv_usage().used_bytes}
    try:
        big = stepper.add([1, 2, 3], SamplingParams(max_tokens=10**7))
        stepper.stop(big)
        checks["beyond_budget"] = "no error"
    except ResourceExhausted as exc:
        checks["beyond_budget"] = f"ResourceExhausted: {exc}"
    before = e.prefix_counters()
    first = generate(e, ids, 16)
    second = generate(e, ids, 16)
    after = e.prefix_counters()
    checks["prefix_repeat_equal"] = first == second
    checks["prefix_local_tokens"] = after["local"] - before["local"]
    # Penalties in the static (captured) step: a penalised greedy row decodes the same alone and beside
    # others, min_tokens keeps EOS out, and the answer differs from the unpenalised one.
    chat = list(e.tokenizer.encode(CHAT[0]).ids)
    penalised = SamplingParams(max_tokens=24, repetition_penalty=1.3, frequency_penalty=0.4, min_tokens=24)
    alone = generate(e, chat, 24, sampling=penalised)
    beside_others = EngineStepper(e)
    others = [
        beside_others.add(list(e.tokenizer.encode(t).ids), SamplingParams(max_tokens=60)) for t in ("Hello", STORY)
    ]
    try:
        for other in others:
            beside_others.run_until(other)
        beside = beside_others.generate(chat, penalised)  # the others decode in the same steps
    finally:
        beside_others.close()
    checks["penalties_batch_invariant"] = alone == beside
    checks["penalties_min_tokens_held"] = len(alone) == 24 and not set(alone) & set(e.info.eos_token_ids)
    checks["penalties_change_answer"] = alone != generate(e, chat, 24)
    return checks


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def throughput(e: CloudEngine, n: int, levels: Sequence[int], rounds: int) -> dict[str, Any]:
    """EOS ignored: every sequence decodes exactly ``n`` tokens."""
    e._info = dataclasses.replace(e.info, eos_token_ids=frozenset())  # benchmark only: fixed lengths
    prompts = [list(e.tokenizer.encode(t).ids) for t in CHAT * 2]
    out: dict[str, Any] = {}
    single: list[float] = []
    for _ in range(rounds):  # single stream: tokens after the first over the time they took
        stream = EngineStepper(e)
        seq = stream.add(prompts[0], SamplingParams(max_tokens=n))
        stamps = stream.run([seq], raise_errors=True)[seq].stamps
        single.append((n - 1) / (stamps[-1] - stamps[0]))
    out["single_stream_decode_tok_s"] = statistics.median(single)
    for c in levels:
        walls, steps = [], []
        for r in range(rounds):
            chosen = [prompts[(r + i) % len(prompts)] for i in range(c)]
            s0, t = e.scheduler.steps_total, time.perf_counter()
            results = concurrent(e, chosen, n)
            walls.append(time.perf_counter() - t)
            steps.append(e.scheduler.steps_total - s0)
            assert all(len(x) == n for x in results), "a sequence ended early"
        wall = statistics.median(walls)
        out[f"concurrent_{c}"] = {
            "sequences": c,
            "tokens": c * n,
            "wall_s_median": wall,
            "aggregate_tok_s": c * n / wall,
            "per_stream_tok_s": n / wall,
            "steps": int(statistics.median(steps)),
            "ms_per_step": 1000 * wall / statistics.median(steps),
        }
    return out


def prefill(model: str, device: str, dtype: str, rounds: int) -> dict[str, Any]:
    e = engine(model, device, dtype=dtype, prefix_cache=False, max_step_tokens=512)
    doc = list(e.tokenizer.encode(STORY * 40).ids)
    ids = doc[:512]
    assert len(ids) == 512
    ttfts = []
    for r in range(rounds + 1):
        stepper = EngineStepper(e)
        seq = stepper.add(ids, SamplingParams(max_tokens=1))  # prefix cache off: a full prefill each round
        if r:
            ttfts.append(stepper.run([seq], raise_errors=True)[seq].ttft)
        else:
            stepper.run([seq], raise_errors=True)
    m = e.model
    cache = m.new_cache(32, 16, e.kv_dtype)
    fwd = []
    for r in range(rounds + 1):
        _sync(m.device)
        t = time.perf_counter()
        m.forward([Segment(ids, 0, list(range(32)))], cache)
        _sync(m.device)
        if r:
            fwd.append(time.perf_counter() - t)
    e.close()
    return {
        "prompt_tokens": 512,
        "ttft_ms_median": 1000 * statistics.median(ttfts),
        "ttft_ms_min": 1000 * min(ttfts),
        "forward_ms_median": 1000 * statistics.median(fwd),
        "prefill_tok_s": 512 / statistics.median(fwd),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model or str(model_paths().hf_dir)
    e = engine(model, args.device, dtype=args.dtype)
    dev = e.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    report: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": f"{dev} ({name})",
        "dtype": str(e.dtype).removeprefix("torch."),
        "kv_dtype": str(e.kv_dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "model": model,
        "command": "python -m benchmarks.cloud.gpu " + " ".join(sys.argv[1:]),
    }
    generate(e, list(e.tokenizer.encode(CHAT[0]).ids), 8)  # warm-up

    def section(name: str, fn: Callable[[], Any]) -> None:
        """One part of the report; a failure is recorded and the others still run."""
        try:
            report[name] = fn()
        except Exception:
            report.setdefault("errors", {})[name] = traceback.format_exc()
            print(report["errors"][name], file=sys.stderr)
        print(f"{name}: {json.dumps(report.get(name))}", flush=True)

    if not args.skip_parity:
        ref = engine(model, "cpu", dtype="float32")
        section("parity_vs_cpu_fp32", lambda: parity(e, ref, args.tokens))
        ref.close()
    section("batching_invariance", lambda: invariance(e, args.tokens))
    section("engine_checks", lambda: engine_checks(e))
    section("throughput", lambda: throughput(e, args.bench_tokens, args.levels, args.rounds))
    e.close()
    section("prefill", lambda: prefill(model, args.device, args.dtype, args.rounds + 2))
    if dev.type == "cuda":
        report["max_memory_allocated_mib"] = torch.cuda.max_memory_allocated(dev) / 2**20
    return report


def markdown(r: dict[str, Any]) -> str:
    lines = [
        f"# Cloud engine on {r['device']}",
        "",
        f"Measured {r['date']} with `{r['command']}`: the gpu_worker's `CloudEngine`, dtype {r['dtype']} "
        f"(KV {r['kv_dtype']}), torch {r['torch']}, model `{r['model']}`.",
    ]
    if "parity_vs_cpu_fp32" in r:
        lines += [
            "",
            "## Greedy parity with the same engine on the CPU (float32)",
            "",
            "| prompt | prompt tokens | tokens | equal prefix | teacher-forced top-1 agreement "
            "| CPU top-1/top-2 margin where they first disagree |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for p in r["parity_vs_cpu_fp32"]:
            tf = p["teacher_forced"]
            margin = f"{tf['ref_top1_top2_margin_there']:.3f}" if "ref_top1_top2_margin_there" in tf else "-"
            prompt = p["prompt"].replace("\n", "\\n").replace("|", "\\|")
            lines.append(
                f"| `{prompt}` | {p['prompt_tokens']} | {p['tokens']} | {p['equal_prefix']} | "
                f"{100 * tf['top1_agreement']:.1f} % | {margin} |"
            )
    for name, error in r.get("errors", {}).items():
        lines += ["", f"**{name} failed:**", "", "```", error.strip(), "```"]
    inv = r.get("batching_invariance")
    if inv is None or "throughput" not in r or "prefill" not in r:
        return "\n".join(lines) + "\n"
    lines += ["", "## Batching invariance (greedy, vs each prompt alone)", ""]
    for k in ("staggered_4", "batch_8", "batch_32"):
        row = inv[k]
        extra = f" (first differing positions {row['first_diffs']})" if row["first_diffs"] else ""
        lines.append(f"* {k}: {row['equal_to_alone']}/{row['sequences']} equal{extra}")
    lines.append(f"* engine checks: {json.dumps(r.get('engine_checks'))}")
    t, p = r["throughput"], r["prefill"]
    lines += [
        "",
        "## Throughput (EOS ignored; medians over rounds)",
        "",
        f"Single-stream decode: **{t['single_stream_decode_tok_s']:.1f} tokens/s**.",
        "",
        "| concurrent sequences | tokens | wall (s) | aggregate tokens/s | per stream tokens/s | ms per step |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for key, row in t.items():
        if key.startswith("concurrent_"):
            lines.append(
                f"| {row['sequences']} | {row['tokens']} | {row['wall_s_median']:.2f} | {row['aggregate_tok_s']:.0f} | "
                f"{row['per_stream_tok_s']:.1f} | {row['ms_per_step']:.2f} |"
            )
    lines += [
        "",
        f"Prefill of a {p['prompt_tokens']}-token prompt: time to first token through the engine "
        f"{p['ttft_ms_median']:.1f} ms (median; min {p['ttft_ms_min']:.1f}), one bare model forward "
        f"{p['forward_ms_median']:.1f} ms ({p['prefill_tok_s']:.0f} tokens/s).",
    ]
    if "max_memory_allocated_mib" in r:
        lines.append(f"Peak GPU memory allocated: {r['max_memory_allocated_mib']:.0f} MiB.")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--engine-report" in args:
        args.remove("--engine-report")
        return engine_report(args)
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.cloud.gpu",
        description=__doc__.splitlines()[0],
        epilog="--engine-report [--help]: the engine report of the prepared SmolLM2 checkpoint instead.",
    )
    cloud_gpu_targets.add_arguments(parser)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parsed = parser.parse_args(args)
    parsed.command = "python -m benchmarks.cloud.gpu " + " ".join(args)
    return cloud_gpu_targets.main_targets(parsed)


def engine_report(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.cloud.gpu --engine-report", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default="", help="HF checkpoint dir (default: the prepared smollm2 hf/)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu", "auto"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per parity/invariance prompt")
    parser.add_argument("--bench-tokens", type=int, default=256, help="tokens per sequence in the throughput runs")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32], help="concurrent sequences")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-parity", action="store_true", help="no CPU float32 reference engine")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = parser.parse_args(argv)
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cloud_gpu.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "cloud_gpu.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
