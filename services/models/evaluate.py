"""`meshserve models eval`: what quantization (and later distillation) costs in quality.

Measures, on held-out text that ships with meshserve (Shakespeare, public domain, not used for
training), for every model variant given:

* perplexity (teacher-forced, non-overlapping windows);
* top-1 agreement with the fp32 reference (fraction of positions where both models' argmax match);
* 32-token greedy agreement: for prompts cut from the text, the fraction of the first 32 greedy
  tokens that equal the fp32 reference's, position by position.

Variants: an HF checkpoint directory (run with torch) or an onnxruntime-genai model directory
(its ``model.onnx`` run with onnxruntime). Offline: no grpc, no network.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

HELDOUT = Path(__file__).parent / "data" / "heldout_tempest.txt"

Logits = Callable[[list[int]], np.ndarray]
"""Maps token ids (one sequence) to logits of shape [len(ids), vocab]."""
Greedy = Callable[[list[int], int], list[int]]
"""Maps (prompt ids, n) to the first ``n`` greedy tokens after the prompt."""


@dataclass(frozen=True)
class Variant:
    """One model under evaluation: teacher-forced logits, and (optionally faster) greedy decoding."""

    logits: Logits
    greedy: Greedy | None = None

    def generate(self, prompt: list[int], n: int) -> list[int]:
        return self.greedy(prompt, n) if self.greedy is not None else _greedy(self.logits, prompt, n)


@dataclass
class EvalResult:
    """One model's row of the quality table: perplexity and its agreement with the fp32 teacher."""

    name: str
    perplexity: float
    top1_agreement: float
    greedy32_agreement: float
    tokens: int


def torch_logits(hf_dir: Path, threads: int = 0) -> Logits:
    import torch
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()

    def run(ids: list[int]) -> np.ndarray:
        with torch.inference_mode():
            out = model(torch.tensor([ids]))
        return out.logits[0].float().numpy()

    return run


def onnx_logits(model_dir: Path, threads: int = 0) -> Logits:
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(model_dir / "model.onnx"), options, providers=["CPUExecutionProvider"])
    decoder = json.loads((model_dir / "genai_config.json").read_text())["model"]["decoder"]
    layers, kv_heads, head = decoder["num_hidden_layers"], decoder["num_key_value_heads"], decoder["head_size"]

    def run(ids: list[int]) -> np.ndarray:
        feeds: dict[str, Any] = {
            "input_ids": np.array([ids], dtype=np.int64),
            "attention_mask": np.ones((1, len(ids)), dtype=np.int64),
        }
        empty = np.zeros((1, kv_heads, 0, head), dtype=np.float32)
        for i in range(layers):
            feeds[f"past_key_values.{i}.key"] = empty
            feeds[f"past_key_values.{i}.value"] = empty
        (logits,) = session.run(["logits"], feeds)
        return np.asarray(logits[0], dtype=np.float32)

    return run


def og_greedy(model_dir: Path) -> Greedy:
    """Greedy decoding with onnxruntime-genai (what the edge worker runs), KV cached."""
    import onnxruntime_genai as og

    model = og.Model(str(model_dir))

    def run(prompt: list[int], n: int) -> list[int]:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + n, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(prompt)
        out: list[int] = []
        for _ in range(n):
            generator.generate_next_token()
            out.append(int(generator.get_next_tokens()[0]))
        return out

    return run


def torch_greedy(hf_dir: Path) -> Greedy:
    """Greedy decoding with transformers' ``generate`` (KV cached, no sampling)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()

    def run(prompt: list[int], n: int) -> list[int]:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
            )
        return [int(t) for t in out[0, len(prompt) :]]

    return run


def load_variant(path: Path, threads: int = 0) -> Variant:
    """An HF checkpoint dir (torch) or an onnxruntime-genai dir (onnxruntime + og greedy)."""
    if (path / "genai_config.json").is_file():
        return Variant(onnx_logits(path, threads), og_greedy(path))
    if (path / "config.json").is_file():
        return Variant(torch_logits(path, threads), torch_greedy(path))
    raise FileNotFoundError(f"{path} is neither an HF checkpoint (config.json) nor an onnxruntime-genai model")


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _greedy(logits: Logits, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(logits(ids)[-1].argmax()))
    return ids[len(prompt) :]


def evaluate(
    variants: dict[str, Variant],
    reference: str,
    ids: Sequence[int],
    window: int = 512,
    greedy_prompts: int = 4,
    greedy_tokens: int = 32,
    progress: Callable[[str], None] | None = None,
) -> list[EvalResult]:
    """Evaluate every variant against ``variants[reference]`` on ``ids``."""
    windows = [list(ids[i : i + window]) for i in range(0, len(ids) - 1, window) if len(ids[i : i + window]) > 1]
    ref = variants[reference]
    ref_argmax = [ref.logits(w)[:-1].argmax(-1) for w in windows]
    starts = np.linspace(0, max(0, len(ids) - 96), greedy_prompts).astype(int)
    prompts = [list(ids[s : s + 64]) for s in starts]
    ref_greedy = [ref.generate(p, greedy_tokens) for p in prompts]
    results = []
    for name, variant in variants.items():
        if progress is not None:
            progress(name)
        nll, count, agree = 0.0, 0, 0
        for w, ref_top in zip(windows, ref_argmax, strict=True):
            logp = _log_softmax(variant.logits(w))[:-1]
            targets = np.array(w[1:])
            nll -= float(logp[np.arange(len(targets)), targets].sum())
            count += len(targets)
            agree += int((logp.argmax(-1) == ref_top).sum())
        same = 0
        for p, ref_tokens in zip(prompts, ref_greedy, strict=True):
            got = ref_tokens if name == reference else variant.generate(p, greedy_tokens)
            same += sum(a == b for a, b in zip(got, ref_tokens, strict=True))
        results.append(
            EvalResult(
                name=name,
                perplexity=math.exp(nll / count),
                top1_agreement=agree / count,
                greedy32_agreement=same / (greedy_tokens * len(prompts)),
                tokens=count,
            )
        )
    return results


def markdown_table(results: list[EvalResult], reference: str) -> str:
    ref = next(r for r in results if r.name == reference)
    lines = [
        "| variant | perplexity | vs fp32 | top-1 agreement | 32-token greedy agreement |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results:
        delta = (r.perplexity / ref.perplexity - 1) * 100
        lines.append(
            f"| {r.name} | {r.perplexity:.2f} | {delta:+.1f} % | {r.top1_agreement * 100:.1f} % | "
            f"{r.greedy32_agreement * 100:.1f} % |"
        )
    return "\n".join(lines) + "\n"


def as_dicts(results: list[EvalResult]) -> list[dict[str, Any]]:
    return [asdict(r) for r in results]


# ------------------------------------------------------------------------------------------ CLI


def default_variants(models_dir: Path | None = None, model_id: str | None = None) -> dict[str, Path]:
    """fp32 teacher, its INT4 build, and the distilled student (fp32, INT4) where they exist."""
    from services.common.model_paths import DEFAULT_MODEL_ID, model_paths

    paths = model_paths(model_id or DEFAULT_MODEL_ID, models_dir)
    candidates = {
        "fp32": paths.hf_dir,
        "int4": paths.edge_dir,
        "student fp32": paths.root / "student" / "hf",
        "student int4": paths.root / "student" / "edge-int4",
    }
    return {name: path for name, path in candidates.items() if path.is_dir()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models-dir", type=Path, default=None, help="models directory (default: prepared models)")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="evaluate this HF or onnxruntime-genai dir too (repeatable); the first variant is the reference",
    )
    parser.add_argument("--only", action="store_true", help="evaluate only the --variant dirs, not the defaults")
    parser.add_argument("--text", type=Path, default=HELDOUT, help="held-out text (default: The Tempest excerpt)")
    parser.add_argument("--window", type=int, default=512, help="perplexity window in tokens (default 512)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts for the 32-token greedy agreement")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0 = library default)")
    parser.add_argument(
        "--output",
        type=Path,
        default=Path("docs/models/eval.md"),
        help="markdown table to write (a .json with the raw numbers is written beside it)",
    )


def run(args: argparse.Namespace) -> int:
    """Entry point of ``meshserve models eval``."""
    from tokenizers import Tokenizer

    dirs: dict[str, Path] = {} if args.only else default_variants(args.models_dir)
    for spec in args.variant:
        name, _, where = spec.partition("=")
        if not where:
            print(f"meshserve models eval: --variant {spec} must look like NAME=DIR", file=sys.stderr)
            return 2
        dirs[name] = Path(where).expanduser()
    if not dirs:
        print("meshserve models eval: nothing to evaluate; run `meshserve models prepare` first", file=sys.stderr)
        return 1
    reference = next(iter(dirs))
    tokenizer = Tokenizer.from_file(str(dirs[reference] / "tokenizer.json"))
    ids = tokenizer.encode(args.text.read_text()).ids
    variants = {name: load_variant(path, args.threads) for name, path in dirs.items()}
    results = evaluate(
        variants,
        reference,
        ids,
        window=args.window,
        greedy_prompts=args.prompts,
        progress=lambda name: print(f"evaluating {name} ...", file=sys.stderr),
    )
    table = markdown_table(results, reference)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    header = (
        f"Held-out text: `{args.text.name}` ({len(ids)} tokens, windows of {args.window}); reference: "
        f"{reference}. Reproduce: `meshserve models eval`.\n\n"
    )
    args.output.write_text(header + table)
    doc = {"reference": reference, "dirs": {k: str(v) for k, v in dirs.items()}, "results": as_dicts(results)}
    args.output.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    print(table, end="")
    print(f"written to {args.output}")
    return 0
