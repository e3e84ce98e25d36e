"""The router's request metrics, recorded for every caller of :class:`~services.router.frontend.api.RouterAPI`
(the embedded gateway and the router's gRPC servicer): duration by status and tier, tokens by tier."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

from services.common.errors import MeshError
from services.common.metrics import REQUEST_DURATION, TOKENS
from services.router.balancer.core import SERVICE
from services.router.types import Done, Event


class _Observation:
    """Duration by status, token counters, for one request or chat turn."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.tier = "none"

    def record(self, event: Event) -> None:
        if isinstance(event, Done):
            self.tier = "cache" if event.route.cache_hit or not event.route.tier else event.route.tier.value
            if event.index == 0:  # n choices share one prompt
                TOKENS.labels(SERVICE, self.tier, "input").inc(event.prompt_tokens)
            TOKENS.labels(SERVICE, self.tier, "output").inc(event.completion_tokens)


@contextlib.contextmanager
def observe() -> Iterator[_Observation]:
    """The router's request metrics for the block: duration by status and tier, tokens."""
    obs = _Observation()
    status = "OK"
    try:
        yield obs
    except MeshError as exc:
        status = exc.code
        raise
    except (asyncio.CancelledError, GeneratorExit):
        status = "CANCELLED"
        raise
    except BaseException:
        status = "INTERNAL"
        raise
    finally:
        REQUEST_DURATION.labels(SERVICE, obs.tier, status).observe(time.perf_counter() - obs.started)


@contextlib.contextmanager
def observe_refusal() -> Iterator[None]:
    """For an edge's work before it calls the API (converting its request): a refusal there is recorded
    as the router's metrics record a failed request; success records nothing (the API does)."""
    started = time.perf_counter()
    try:
        yield
    except MeshError as exc:
        REQUEST_DURATION.labels(SERVICE, "none", exc.code).observe(time.perf_counter() - started)
        raise
