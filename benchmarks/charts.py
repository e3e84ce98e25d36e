"""PNG charts of load runs (matplotlib, headless): latency percentiles vs load, tokens/s vs load."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _x_label(report: dict[str, Any]) -> str:
    return "offered load (requests/s, Poisson)" if report["mode"] == "open" else "concurrency (closed loop)"


def latency_chart(report: dict[str, Any], path: Path, metric: str = "e2e_ms") -> Path:
    """One line per target and percentile (p50 solid, p95 dashed, p99 dotted) of ``metric``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (target, steps) in enumerate(report["targets"].items()):
        xs = [s["load"] for s in steps]
        color = colors[i % len(colors)]  # one colour per target, one line style per percentile
        for q, style in (("p50", "-"), ("p95", "--"), ("p99", ":")):
            ys = [s["summary"][f"{metric}_{q}"] for s in steps]
            ax.plot(xs, ys, style, color=color, marker="o", label=f"{target} {q}")
    ax.set_xlabel(_x_label(report))
    ax.set_ylabel(metric.replace("_ms", "").upper() + " latency (ms)")
    ax.set_yscale("log")
    ax.set_title(f"{report['name']}: {metric.replace('_ms', '')} latency vs load")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def throughput_chart(report: dict[str, Any], path: Path) -> Path:
    """Tokens/s (solid) and requests/s (dashed, right axis) per target vs load."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    right = ax.twinx()
    for target, steps in report["targets"].items():
        xs = [s["load"] for s in steps]
        line = ax.plot(xs, [s["summary"]["tokens_per_s"] for s in steps], "-", marker="o", label=f"{target} tok/s")
        right.plot(
            xs,
            [s["summary"]["requests_per_s"] for s in steps],
            "--",
            color=line[0].get_color(),
            label=f"{target} req/s",
        )
    ax.set_xlabel(_x_label(report))
    ax.set_ylabel("tokens/s (solid)")
    right.set_ylabel("requests/s (dashed)")
    ax.set_title(f"{report['name']}: throughput vs load")
    ax.grid(True, alpha=0.3)
    handles = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
