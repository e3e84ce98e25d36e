"""Soak probes against a real redis-server: INFO counters, fds by kind, Redis clients by owner."""

from __future__ import annotations

import random
import socket

import psutil
import redis.asyncio as aioredis

from benchmarks.load.soak import FILL_PROMPTS, fd_change, fill_items, redis_summary
from benchmarks.load.soak_probe import Endpoints, LogCounter, fd_kinds, port_owners, redis_client_owners, redis_stats
from services.router.frontend.encoding import ENCODED_PROMPTS
from tests.helpers import RedisServer


async def test_redis_stats_and_owners_name_the_process_holding_each_connection(
    redis_srv: RedisServer, redis_url: str
) -> None:
    assert redis_srv.proc is not None
    procs = {"redis-server": psutil.Process(redis_srv.proc.pid), "me": psutil.Process()}
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.set("k", b"x" * 1000)
        stats = await redis_stats(client)
        assert stats["maxmemory"] == 256 * 2**20 and stats["keys"] == 1.0 and stats["used_memory"] > 0
        assert stats["connected_clients"] >= 1 and stats["evicted_keys"] >= 0
        ports = port_owners(procs)
        assert redis_client_owners(await client.client_list(), ports).get("me", 0) >= 1
        assert fd_kinds(procs["me"], ports).get("tcp->redis-server", 0) >= 1
        server_side = fd_kinds(procs["redis-server"], ports)
        assert server_side.get("listen", 0) >= 1 and server_side.get("tcp<-me", 0) >= 1
        assert redis_client_owners([{"addr": "127.0.0.1:1", "laddr": "127.0.0.1:2"}], ports) == {
            "other (not a mesh process: this benchmark, redis-cli)": 1
        }
    finally:
        await client.aclose()


def test_fd_kinds_counts_listening_unix_and_pipe_fds() -> None:
    me = psutil.Process()
    listener = socket.create_server(("127.0.0.1", 0))
    a, b = socket.socketpair()
    client = socket.create_connection(listener.getsockname())  # a TCP connection both ways in this process
    served, _ = listener.accept()
    try:
        before = fd_kinds(me, Endpoints())
        extra = socket.create_server(("127.0.0.1", 0))
        after = fd_kinds(me, Endpoints())
        extra.close()
        assert after["listen"] == before["listen"] + 1 and before["unix"] >= 2
        assert sum(after.values()) == sum(before.values()) + 1
        # peers outside the mesh: our end that connected, and the end our listener accepted
        assert before.get("tcp->other", 0) >= 1 and before.get("tcp<-other", 0) >= 1
    finally:
        for s in (listener, a, b, client, served):
            s.close()


def test_redis_summary_tells_when_the_cache_filled_and_counts_evictions() -> None:
    cap = 32.0 * 2**20
    used = [10e6, 20e6, 0.96 * cap, 0.99 * cap, 0.98 * cap, 0.99 * cap]
    series = {
        "used_memory": [(i * 30.0, u) for i, u in enumerate(used)],
        "maxmemory": [(i * 30.0, cap) for i in range(6)],
        "evicted_keys": [(i * 30.0, float(e)) for i, e in enumerate([0, 0, 5, 50, 90, 130])],
    }
    r = redis_summary(series, warmup_s=90.0)
    assert r["full_at_s"] == 60.0 and r["full_before_baseline"] and r["baseline_t"] == 90.0
    assert r["evicted_during_soak"] == 80.0
    late = redis_summary(series, warmup_s=30.0)
    assert late["full_at_s"] == 60.0 and not late["full_before_baseline"]
    never = redis_summary({**series, "used_memory": [(i * 30.0, 1e6) for i in range(6)]}, 30.0)
    assert never["full_at_s"] is None and not never["full_before_baseline"]


def test_fd_change_compares_the_first_sample_of_the_baseline_with_the_last() -> None:
    series = [(0.0, {"pipe": 2}), (60.0, {"pipe": 2, "tcp->redis-server": 3}), (120.0, {"tcp->redis-server": 4})]
    change = fd_change(series, warmup_s=50.0)
    assert change["baseline"] == {"pipe": 2, "tcp->redis-server": 3} and change["final_t"] == 120.0


def test_default_fill_outnumbers_the_router_tokenizer_lru() -> None:
    assert FILL_PROMPTS > ENCODED_PROMPTS


def test_fill_items_are_distinct_one_token_prompts_of_both_kinds() -> None:
    items = fill_items(300, 20, random.Random(1), tag="t-")
    assert len(items) == 320 and sum(i.kind == "chat" for i in items[:40]) == 20
    assert all(i.max_tokens == 1 and not i.cacheable for i in items)
    assert len({i.messages for i in items}) == 320


def test_log_counter_counts_warnings_and_errors_by_phase_service_and_event() -> None:
    logs = LogCounter()
    logs("router", '{"event": "request_done", "level": "info"}')
    logs.phase = "fill"
    for _ in range(2):
        logs("router", '{"event": "worker_ejected", "level": "warning", "worker": "edge-0"}')
    logs("gateway", '{"event": "redis_down", "level": "error"}')
    logs("gateway", "Traceback (most recent call last): not JSON, no level")
    assert logs.summary() == [
        {"phase": "fill", "service": "router", "level": "warning", "event": "worker_ejected", "count": 2},
        {"phase": "fill", "service": "gateway", "level": "error", "event": "redis_down", "count": 1},
    ]
