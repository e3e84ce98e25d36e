"""Lifetime counters and a recent tokens-per-second rate, kept by the event loop (the runner and the
output processor update them; the load report reads a snapshot)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class CounterSnapshot:
    """A copy of the counters."""

    sequences_started_total: int
    sequences_cancelled_total: int
    tokens_generated_total: int
    prefill_tokens_total: int
    recent_tokens_per_second: float
    prompt_tokens_total: int = 0


class WorkerCounters:
    """Event-loop counters. Token rate is averaged over the last ``window_s`` seconds (1 s buckets)."""

    def __init__(self, window_s: float = 5.0) -> None:
        self._window_s = window_s
        self._now = time.monotonic
        self.reset()

    def reset(self) -> None:
        """Back to zero (also after the warm-up, which is not traffic)."""
        self._started = self._cancelled = self._tokens = self._prefill = self._prompt = 0
        self._buckets: deque[list[float]] = deque()  # [second, count]

    def sequence_started(self) -> None:
        self._started += 1

    def sequence_cancelled(self) -> None:
        self._cancelled += 1

    def prefilled(self, tokens: int, prompt_tokens: int = 0) -> None:
        """A turn's first step ran ``tokens`` of its ``prompt_tokens`` through prefill (rest: held KV)."""
        self._prefill += tokens
        self._prompt += prompt_tokens

    def token_generated(self, n: int = 1) -> None:
        second = float(int(self._now()))
        self._tokens += n
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1][1] += n
        else:
            self._buckets.append([second, float(n)])
        self._trim(second)

    def _trim(self, now: float) -> None:
        while self._buckets and self._buckets[0][0] <= now - self._window_s:
            self._buckets.popleft()

    def snapshot(self) -> CounterSnapshot:
        self._trim(float(int(self._now())))
        recent = sum(count for _, count in self._buckets)
        return CounterSnapshot(
            sequences_started_total=self._started,
            sequences_cancelled_total=self._cancelled,
            tokens_generated_total=self._tokens,
            prefill_tokens_total=self._prefill,
            recent_tokens_per_second=recent / self._window_s,
            prompt_tokens_total=self._prompt,
        )
