"""Latency statistics for benchmark reports."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class StreamSample:
    """Timings of one streamed request, in seconds from its start."""

    ttft: float
    token_times: list[float] = field(default_factory=list)
    total: float = 0.0
    tokens: int = 0

    @property
    def inter_token(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


def summarize(samples: list[StreamSample]) -> dict[str, float]:
    """p50/p99 TTFT and inter-token latency (ms), decode tokens/s per stream, requests."""
    ttft = [s.ttft * 1000 for s in samples]
    itl = [d * 1000 for s in samples for d in s.inter_token]
    rates = [
        (s.tokens - 1) / (s.token_times[-1] - s.token_times[0])
        for s in samples
        if s.tokens > 1 and s.token_times[-1] > s.token_times[0]
    ]
    return {
        "requests": len(samples),
        "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_p99": percentile(ttft, 99),
        "itl_ms_p50": percentile(itl, 50),
        "itl_ms_p99": percentile(itl, 99),
        "decode_tokens_per_s": statistics.fmean(rates) if rates else float("nan"),
    }
