"""Guard: the watchdog's timeouts, cancellation from outside, counters exported to Prometheus."""

from __future__ import annotations

import asyncio
import gc

import pytest
from prometheus_client import REGISTRY

from services.store.breaker import State
from services.store.guard import FAILED, SKIPPED, Guard


async def _hang(_client: object) -> None:
    await asyncio.Event().wait()


async def _answer(_client: object) -> str:
    await asyncio.sleep(0)
    return "ok"


async def test_a_call_past_its_timeout_fails_and_opens_the_breaker() -> None:
    guard = Guard(object(), timeout_s=0.02)  # type: ignore[arg-type]
    guard.breaker.failure_threshold = 1
    assert await asyncio.wait_for(guard.run("get", _hang), 5) is FAILED
    assert guard.breaker.state is State.OPEN
    assert await guard.run("get", _answer) is SKIPPED  # open: Redis is not called
    assert not guard._inflight


async def test_a_per_call_timeout_overrides_the_guard_default() -> None:
    guard = Guard(object(), timeout_s=60)  # type: ignore[arg-type]
    assert await asyncio.wait_for(guard.run("kv_load", _hang, timeout_s=0.02), 5) is FAILED


async def test_calls_within_the_timeout_succeed_and_close_the_breaker() -> None:
    guard = Guard(object(), timeout_s=0.05)  # type: ignore[arg-type]
    guard.breaker.failures = 1
    results = await asyncio.gather(*(guard.run("get", _answer) for _ in range(50)))
    assert results == ["ok"] * 50 and guard.breaker.failures == 0
    assert not guard._inflight


async def test_cancelling_the_caller_still_cancels_it() -> None:
    guard = Guard(object(), timeout_s=60)  # type: ignore[arg-type]
    task = asyncio.create_task(guard.run("get", _hang))
    await asyncio.sleep(0)  # let it enter the call
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert guard.breaker.failures == 0 and not guard._inflight


async def test_a_cancelled_probe_lets_the_next_caller_probe() -> None:
    guard = Guard(object(), timeout_s=60)  # type: ignore[arg-type]
    guard.breaker.failure_threshold, guard.breaker.reset_s = 1, 0.0
    guard.breaker.failure()  # open; reset_s 0: the next caller is the half-open probe
    probe = asyncio.create_task(guard.run("get", _hang))
    await asyncio.sleep(0)
    assert guard.breaker.state is State.HALF_OPEN
    probe.cancel()
    with pytest.raises(asyncio.CancelledError):
        await probe
    assert await guard.run("get", _answer) == "ok"  # not stuck behind a probe that never answers
    assert guard.breaker.state is State.CLOSED


async def test_an_outer_timeout_is_not_mistaken_for_ours() -> None:
    guard = Guard(object(), timeout_s=60)  # type: ignore[arg-type]
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.02):
            await guard.run("get", _hang)
    assert guard.breaker.failures == 0


async def test_no_client_is_skipped() -> None:
    assert await Guard(None).run("get", _answer) is SKIPPED


def _sample(service: str, result: str) -> float | None:
    return REGISTRY.get_sample_value(
        "meshserve_cache_lookups_total", {"service": service, "kind": "response", "result": result}
    )


async def test_counts_reach_prometheus_and_outlive_the_guard() -> None:
    guard = Guard(None, service="unit-guard-counts")
    guard.count("response", "hit", 3)
    guard.count("response", "miss")
    guard.count("response", "stored", store=True)
    assert _sample("unit-guard-counts", "hit") == 3 and _sample("unit-guard-counts", "miss") == 1
    assert (
        REGISTRY.get_sample_value(
            "meshserve_cache_stores_total", {"service": "unit-guard-counts", "kind": "response", "result": "stored"}
        )
        == 1
    )
    del guard
    gc.collect()
    assert _sample("unit-guard-counts", "hit") == 3  # a counter never goes back
    again = Guard(None, service="unit-guard-counts")
    again.count("response", "hit")
    assert _sample("unit-guard-counts", "hit") == 4
