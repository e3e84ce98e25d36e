"""Redis as the mesh starts it runs under SCHED_BATCH (``spawn_redis``, through ``yield_on_wakeup``) and
its memory-overcommit warning becomes one line (``redis_sink``)."""

from __future__ import annotations

import os
import tempfile

import pytest
import redis.asyncio as aioredis

from services.local.redis_server import REDIS_OVERCOMMIT_NOTE, redis_sink, spawn_redis


def _policies(pid: int) -> list[int]:
    return [os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux-only")
@pytest.mark.parametrize("batch", [True, False])
async def test_spawn_redis_starts_a_redis_that_answers_under_the_asked_policy(batch: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = await spawn_redis(tmp, lambda _name, _line: None, dict(os.environ), batch=batch)
        try:
            assert proc.proc is not None
            want = os.SCHED_BATCH if batch else os.SCHED_OTHER
            assert set(_policies(proc.proc.pid)) == {want}
            client = aioredis.Redis.from_url(url)
            try:
                assert await client.set("k", "v")
                assert await client.get("k") == b"v"
            finally:
                await client.aclose()
        finally:
            await proc.stop()


def test_redis_sink_replaces_the_overcommit_warning_with_one_line() -> None:
    got: list[tuple[str, str]] = []
    relay = redis_sink(lambda name, line: got.append((name, line)))
    relay("redis", "1:M 27 Nov 2026 01:28:09.216 # Server initialized")
    relay("redis", "1:M 27 Nov 2026 01:28:09.216 # WARNING Memory overcommit must be enabled! Without it, ...")
    assert got == [("redis", "1:M 27 Nov 2026 01:28:09.216 # Server initialized"), ("redis", REDIS_OVERCOMMIT_NOTE)]
