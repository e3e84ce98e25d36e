"""What the gateway records of each call: latency and token metrics, and one access-log line.

The access log (``request_done``, on by default, ``MESHSERVE_GATEWAY_ACCESS_LOG``) carries the call's
method, status, tier, worker and route reason, token counts, time to first token and duration; the
request id, tenant and key id come from the bound context (:meth:`GatewayServicer._admit`). It
carries no prompt text unless ``MESHSERVE_GATEWAY_LOG_PROMPTS`` is on (for debugging: the prompts,
or a chat's message texts, each clipped to ``PROMPT_CHARS``), and never the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import structlog

from services.common.errors import MeshError
from services.common.metrics import INTER_TOKEN, REQUEST_DURATION, TOKENS, TTFT
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.gateway.admission import Ticket
from services.gateway.config import GatewaySettings

log = structlog.get_logger(__name__)
SERVICE = "gateway"
PROMPT_CHARS = 2000
PROMPTS_LOGGED = 16  # prompt texts kept for a call's log line (a chat may have any number of turns)


def _tier_label(tier: int) -> str:
    return (
        pb.Tier.Name(pb.Tier.ValueType(tier)).removeprefix("TIER_").lower() if tier in pb.Tier.values() else "unknown"
    )


class Observed:
    """Latency and token metrics of one call; the tier label is known only from the final frame."""

    def __init__(self, method: str, log_prompts: bool = False) -> None:
        self.method = method
        self.prompts: list[str] | None = [] if log_prompts else None
        self.start = self.turn_start = time.perf_counter()
        self.ttfts: list[float] = []
        self.gaps: list[float] = []
        self.last: float | None = None
        self.tier = "unknown"
        self.status = "OK"
        self.worker = self.reason = ""
        self.prompt_tokens = self.completion_tokens = self.turns = 0
        self.prompts_omitted = 0
        self.first_ttft: float | None = None

    def prompt(self, *texts: str) -> None:
        """Keep the call's prompt text for its log line, only where prompts are logged."""
        if self.prompts is not None:
            room = max(0, PROMPTS_LOGGED - len(self.prompts))
            self.prompts.extend(text[:PROMPT_CHARS] for text in texts[:room])
            self.prompts_omitted += len(texts) - min(room, len(texts))

    def turn_started(self) -> None:
        self.turn_start, self.last = time.perf_counter(), None

    def frame(self, token_ids: int, final: pb.Final | None, ticket: Ticket | None = None) -> None:
        now = time.perf_counter()
        if ticket is not None:
            ticket.completion_seen += token_ids
            if final is not None:  # n choices: n finals, the prompt counted once
                used = ticket.used if ticket.used is not None else final.usage.prompt_tokens
                ticket.used = used + final.usage.completion_tokens
        if token_ids:
            if self.last is None:
                self.ttfts.append(now - self.turn_start)
            else:
                self.gaps.append(now - self.last)
            self.last = now
        if final is not None:
            # A hit names the tier whose answer it replays; its latency is the cache's, not that tier's.
            self.tier = "cache" if final.route.cache_hit else _tier_label(final.route.tier)
            self.worker, self.reason = final.route.worker_id, final.route.reason
            self.prompt_tokens += final.usage.prompt_tokens
            self.completion_tokens += final.usage.completion_tokens
            self.turns += 1
            TOKENS.labels(SERVICE, self.tier, "input").inc(final.usage.prompt_tokens)
            TOKENS.labels(SERVICE, self.tier, "output").inc(final.usage.completion_tokens)
            self._flush_latencies()  # a turn's tier is known now: a long chat holds one turn's gaps at most

    def embedded(self, prompt_tokens: int, worker: str) -> None:
        """An Embed call's result: its tokens (input only), served by the cloud tier."""
        self.tier, self.worker, self.reason = "cloud", worker, "embeddings"
        self.prompt_tokens += prompt_tokens
        TOKENS.labels(SERVICE, self.tier, "input").inc(prompt_tokens)

    def _flush_latencies(self) -> None:
        if self.ttfts:
            ttft = TTFT.labels(SERVICE, self.tier)
            for value in self.ttfts:
                ttft.observe(value)
            if self.first_ttft is None:
                self.first_ttft = self.ttfts[0]
            self.ttfts.clear()
        if self.gaps:
            inter = INTER_TOKEN.labels(SERVICE, self.tier)
            for gap in self.gaps:
                inter.observe(gap)
            self.gaps.clear()

    def record(self, access_log: bool) -> None:
        self._flush_latencies()
        duration = time.perf_counter() - self.start
        REQUEST_DURATION.labels(SERVICE, self.tier, self.status).observe(duration)
        if access_log:
            log.info(
                "request_done",
                method=self.method,
                status=self.status,
                tier=self.tier,
                worker=self.worker,
                reason=self.reason,
                turns=self.turns,
                prompt_tokens=self.prompt_tokens,
                completion_tokens=self.completion_tokens,
                ttft_ms=round(self.first_ttft * 1000, 2) if self.first_ttft is not None else None,
                duration_ms=round(duration * 1000, 2),
                **({"prompts": self.prompts} if self.prompts is not None else {}),
                **({"prompts_omitted": self.prompts_omitted} if self.prompts_omitted else {}),
            )


@contextlib.contextmanager
def observe(method: str, settings: GatewaySettings) -> Iterator[Observed]:
    """Observe one call: its status from how the block ends, recorded (and logged) when it ends."""
    observed = Observed(method, settings.access_log and settings.log_prompts)
    try:
        yield observed
    except MeshError as exc:
        observed.status = exc.code
        raise
    except (asyncio.CancelledError, GeneratorExit):
        observed.status = "CANCELLED"
        raise
    except BaseException:
        observed.status = "INTERNAL"
        raise
    finally:
        observed.record(settings.access_log)
