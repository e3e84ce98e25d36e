"""The edge engine's quality with either int4 kernel: perplexity and agreement with fp32 on held-out text.

Issue 27 asks that the edge tier's speed work leave quality unchanged (INT4 perplexity +7.9 % vs fp32
on the held-out text). This measures the graphs the batched engine actually runs, not the model as
built: the edited decoder (int8 LM head with its outlier channels) with the 4-bit matmuls on
onnxruntime's MLAS (``int4_kernel=mlas``) and on our kernel (``native``, when this machine can build
it), teacher-forced over the held-out text in windows (every position's logits: the graph without
its last-positions slice, KV bound in place as the engine binds it), and greedy decoding through the
engine itself (``OrtEngine``, one sequence). The reference is the fp32 checkpoint
(:mod:`services.models.evaluate`: perplexity, top-1 agreement, 32-token greedy agreement).

Prints ``TARGET edge_native_perplexity: <native / mlas> (target <= 1.005): PASS|FAIL`` (native within
0.5 % of the MLAS graph's perplexity, same run) and writes ``docs/benchmarks/edge_quality.{md,json}``.

``meshserve bench edge-quality [--window 512] [--prompts 4] [--threads 2]`` (about 5 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from benchmarks.engine_stepper import EngineStepper
from services.common.model_paths import model_paths
from services.common.sampling import SamplingParams
from services.edge_worker.graph import load_sessions
from services.edge_worker.kvslots import KvSlots
from services.edge_worker.native.kernel import unavailable_reason
from services.edge_worker.ort_engine import OrtEngine
from services.models.evaluate import HELDOUT, EvalResult, Logits, Variant, evaluate, load_variant, markdown_table

TARGET_RATIO = 1.005


def engine_logits(model_dir: Path, int4_kernel: str, threads: int, capacity: int) -> Logits:
    """Teacher-forced logits of the engine's edited graph (every position), one sequence at a time."""
    decoder = json.loads((model_dir / "genai_config.json").read_text())["model"]["decoder"]
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = load_sessions(
        model_dir / decoder["filename"], [options], lm_head="int8", int4_kernel=int4_kernel, last_positions=False
    )[0]
    kv = KvSlots(
        layers=int(decoder["num_hidden_layers"]),
        kv_heads=int(decoder["num_key_value_heads"]),
        head_size=int(decoder["head_size"]),
        slots=1,
        capacity=capacity,
        max_capacity=capacity,
    )

    def run(ids: list[int]) -> np.ndarray:
        io = kv.binding(session, 0, 1)  # a fresh sequence: positions 0.. of the slot are written in place
        io.bind_cpu_input("input_ids", np.array([ids], dtype=np.int64))
        io.bind_cpu_input("attention_mask", np.ones((1, len(ids)), dtype=np.int64))
        io.bind_output("logits")  # unallocated: the windows differ in length
        session.run_with_iobinding(io)
        return np.asarray(io.copy_outputs_to_cpu()[0][0], dtype=np.float32)

    return run


def engine_variant(model_dir: Path, int4_kernel: str, threads: int, window: int) -> Variant:
    engine = OrtEngine(model_dir, model_id="quality", threads=threads, max_batch=2, int4_kernel=int4_kernel)

    def greedy(prompt: list[int], n: int) -> list[int]:
        # exactly n tokens, EOS held off as the fp32 reference's min_new_tokens does
        stepper = EngineStepper(engine)
        seq_id = stepper.add(prompt, SamplingParams(max_tokens=n, temperature=0.0, min_tokens=n))
        return stepper.run([seq_id], raise_errors=True)[seq_id].tokens

    return Variant(engine_logits(model_dir, int4_kernel, threads, max(window, 256)), greedy)


def measure(window: int, prompts: int, threads: int) -> dict[str, Any]:
    from tokenizers import Tokenizer

    paths = model_paths()
    ids = Tokenizer.from_file(str(paths.edge_dir / "tokenizer.json")).encode(HELDOUT.read_text()).ids
    variants: dict[str, Variant] = {"fp32": load_variant(paths.hf_dir, threads)}
    kernels = ["mlas"]
    why = unavailable_reason()
    if why is None:
        kernels.append("native")
    for kernel in kernels:
        variants[f"int4 engine ({kernel})"] = engine_variant(paths.edge_dir, kernel, threads, window)
    results = evaluate(variants, "fp32", ids, window=window, greedy_prompts=prompts)
    return {"results": results, "tokens": len(ids), "native_unavailable": why}


def judged(results: Sequence[EvalResult]) -> dict[str, Any]:
    by = {r.name: r for r in results}
    mlas, native = by.get("int4 engine (mlas)"), by.get("int4 engine (native)")
    if mlas is None or native is None:
        return {"skipped": "the native kernel cannot run on this machine"}
    ratio = native.perplexity / mlas.perplexity
    return {"ratio": ratio, "target": TARGET_RATIO, "pass": ratio <= TARGET_RATIO}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshserve bench edge-quality", description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=512, help="perplexity window in tokens (default 512)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts for the 32-token greedy agreement")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads (default 2)")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/edge_quality.md"))
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    command = f"meshserve bench edge-quality --window {args.window} --prompts {args.prompts} --threads {args.threads}"
    found = measure(args.window, args.prompts, args.threads)
    results: list[EvalResult] = found["results"]
    verdict = judged(results)
    if "skipped" in verdict:
        line = f"TARGET edge_native_perplexity: SKIPPED ({verdict['skipped']}: {found['native_unavailable']})"
    else:
        state = "PASS" if verdict["pass"] else "FAIL"
        line = f"TARGET edge_native_perplexity: {verdict['ratio']:.4f} (target <= {TARGET_RATIO}): {state}"
    fp32 = next(r for r in results if r.name == "fp32").perplexity
    text = "\n".join(
        [
            "# Edge engine quality: the int4 kernels on held-out text",
            "",
            f"Run {started}, load average {load:.1f}. Reproduce: `{command}`.",
            "",
            f"Held-out text: `{HELDOUT.name}` ({found['tokens']} tokens, windows of {args.window}); reference: the "
            "fp32 checkpoint. The int4 rows are the graphs the batched engine runs (int8 LM head), teacher-forced;"
            " their greedy tokens come from the engine itself.",
            "",
            markdown_table(results, "fp32").rstrip(),
            "",
            *(
                f"- {r.name}: perplexity {100 * (r.perplexity / fp32 - 1):+.1f} % vs fp32"
                for r in results
                if r.name != "fp32"
            ),
            "",
            line,
            "",
        ]
    )
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    doc = {
        "date": started,
        "command": command,
        "load_average": load,
        "window": args.window,
        "tokens": found["tokens"],
        "results": [vars(r) for r in results],
        "target": verdict,
    }
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
