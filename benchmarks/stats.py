"""Latency statistics for benchmark reports."""

from __future__ import annotations

import statistics
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any


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


async def time_stream(open_stream: Callable[[], AsyncIterator[Any]]) -> StreamSample:
    """Time one streamed call: ``open_stream()`` starts it; frames carry ``token_ids`` and ``final``.

    The clock starts just before the call is opened; reading stops after the final frame.
    """
    start = time.perf_counter()
    sample = StreamSample(ttft=float("nan"))
    async for frame in open_stream():
        if frame.token_ids:
            now = time.perf_counter() - start
            if sample.tokens == 0:
                sample.ttft = now
            sample.tokens += len(frame.token_ids)
            sample.token_times.append(now)
        if frame.HasField("final"):
            break
    sample.total = time.perf_counter() - start
    return sample


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
