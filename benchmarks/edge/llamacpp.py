"""llama.cpp on the same model and machine, for the edge benchmark's 16-stream target (issue 27).

Uses a llama.cpp build when one is there: its ``llama-batched-bench`` and ``llama-quantize`` tools,
found in ``--llama-cpp-bin`` (a directory or the batched-bench binary) or on PATH. There is no binary
wheel of llama.cpp on the package registry (llama-cpp-python builds it from source, ~10 minutes of
both cores here), so the benchmark does not build one; without a build the target says SKIPPED and why.

What it runs: the shipped Q4_1 GGUF (the source of our model) requantized to Q4_0, as docs/edge.md
measured it (llama.cpp repacks Q4_0 for its AVX2 GEMM, not Q4_1), then ``llama-batched-bench`` with the
benchmark's prompt length and tokens per stream at 1 and N parallel sequences (one ``llama_decode`` of
N rows per step, the same batching as our engine). Throughput is counted as ours is: generated tokens
over the wall time of the round, prefill included (``B * TG / (T_PP + T_TG)``).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BENCH = "llama-batched-bench"
QUANTIZE = "llama-quantize"


def find_tools(hint: Path | None) -> tuple[Path, Path] | str:
    """(batched-bench, quantize) binaries, or a sentence saying why there are none."""
    folders: list[Path] = []
    if hint is not None:
        folders.append(hint if hint.is_dir() else hint.parent)
    found: list[Path] = []
    for name in (BENCH, QUANTIZE):
        path = next((folder / name for folder in folders if (folder / name).is_file()), None)
        if path is None:
            which = shutil.which(name)
            path = Path(which) if which else None
        if path is None:
            where = f"in {folders[0]} or on PATH" if folders else "on PATH (or pass --llama-cpp-bin DIR)"
            return f"no llama.cpp build found: no {name} {where}"
        found.append(path)
    return found[0], found[1]


def q4_0(quantize: Path, source: Path, out_dir: Path, threads: int) -> Path:
    """``source`` requantized to Q4_0 in ``out_dir`` (made once, reused)."""
    out = out_dir / (source.stem.rsplit(".", 1)[0] + ".Q4_0.gguf")
    if not out.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(".partial")
        subprocess.run(
            [str(quantize), "--allow-requantize", str(source), str(partial), "Q4_0", str(threads)],
            check=True,
            capture_output=True,
            timeout=600,
        )
        partial.rename(out)
    return out


def parse_table(text: str) -> list[dict[str, float]]:
    """The rows of batched-bench's markdown table (``| PP | TG | B | ... | S t/s |``) as numbers."""
    header: list[str] | None = None
    rows: list[dict[str, float]] = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else []
        if not cells:
            continue
        if "PP" in cells and "TG" in cells and "B" in cells:
            header = cells
            continue
        if header is None or len(cells) != len(header):
            continue
        try:
            rows.append({name: float(value) for name, value in zip(header, cells, strict=True)})
        except ValueError:  # the |---| rule
            continue
    return rows


def measure(
    tools: tuple[Path, Path],
    source_gguf: Path,
    scratch: Path,
    *,
    threads: int,
    prompt_tokens: int,
    max_tokens: int,
    streams: Sequence[int],
) -> dict[str, Any]:
    """``{"rounds": [{streams, aggregate_tokens_per_s, decode_tokens_per_s}, ...], ...}`` from one run."""
    bench, quantize = tools
    model = q4_0(quantize, source_gguf, scratch, threads)
    context = max(streams) * (prompt_tokens + max_tokens) + 64
    command = [
        str(bench), "-m", str(model), "-c", str(context), "-b", "2048", "-ub", "512",
        "-npp", str(prompt_tokens), "-ntg", str(max_tokens), "-npl", ",".join(str(n) for n in streams),
        "-t", str(threads), "-tb", str(threads),
    ]  # fmt: skip
    done = subprocess.run(command, check=True, capture_output=True, text=True, timeout=900)
    table = parse_table(done.stdout + "\n" + done.stderr)
    rounds = []
    for row in table:
        wall = row["T_PP s"] + row["T_TG s"]
        rounds.append(
            {
                "streams": int(row["B"]),
                "aggregate_tokens_per_s": row["B"] * row["TG"] / wall if wall else float("nan"),
                "decode_tokens_per_s": row["S_TG t/s"],
            }
        )
    if not rounds:
        raise RuntimeError(f"{bench} printed no result table: {done.stdout[-400:]}")
    return {"model": str(model), "command": " ".join(command), "rounds": rounds}


def summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """llama.cpp's runs (one after each mesh round of the largest count) as one result: per stream count
    the medians of its tokens/s, with every run kept under ``samples``."""
    rounds = []
    for streams in sorted({r["streams"] for sample in samples for r in sample["rounds"]}):
        found = [r for sample in samples for r in sample["rounds"] if r["streams"] == streams]
        rounds.append(
            {
                "streams": streams,
                "repeats": len(found),
                "aggregate_tokens_per_s": statistics.median(r["aggregate_tokens_per_s"] for r in found),
                "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in found),
            }
        )
    return {"model": samples[0]["model"], "command": samples[0]["command"], "rounds": rounds, "samples": samples}
