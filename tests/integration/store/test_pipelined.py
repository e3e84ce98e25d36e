"""The pipelined Redis client against a real redis-server: replies in order, scripts, failures."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
import redis
from redis.exceptions import ConnectionError, ResponseError, TimeoutError

from services.store.pipelined import PipelinedRedis, supports
from tests.helpers import RedisServer, free_port, redis_server

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with redis_server() as srv:
        yield srv


@pytest.fixture
async def client(server: RedisServer) -> AsyncIterator[PipelinedRedis]:
    c = PipelinedRedis(server.url, timeout_s=2.0, client_name="pipelined-test")
    yield c
    await c.aclose()


def _pause(server: RedisServer, ms: int) -> None:
    """Make Redis hold every client's commands for ``ms`` milliseconds (a stalled Redis)."""
    admin = redis.Redis(port=server.port)
    try:
        admin.client_pause(ms)
    finally:
        admin.close()


def test_supports_only_plain_tcp_urls() -> None:
    assert supports("redis://127.0.0.1:6379/0")
    assert supports("redis://:secret@localhost")
    assert not supports("rediss://127.0.0.1:6379/0")
    assert not supports("unix:///tmp/redis.sock")
    with pytest.raises(ValueError, match="not a redis:// URL"):
        PipelinedRedis("rediss://127.0.0.1:6379/0")


async def test_replies_of_every_type_and_error_replies(client: PipelinedRedis) -> None:
    assert await client.execute("SET", "pipelined:a", b"\x00bytes\r\n") == b"OK"
    assert await client.execute("GET", "pipelined:a") == b"\x00bytes\r\n"
    assert await client.execute("GET", "pipelined:missing") is None
    assert await client.execute("DEL", "pipelined:n") in (0, 1)
    assert await client.execute("INCRBY", "pipelined:n", 5) == 5
    assert await client.execute("INCRBYFLOAT", "pipelined:n", 0.5) == b"5.5"
    await client.execute("RPUSH", "pipelined:list", "x", "y")
    assert await client.execute("LRANGE", "pipelined:list", 0, -1) == [b"x", b"y"]
    with pytest.raises(ResponseError, match="wrong number of arguments"):
        await client.execute("GET")
    assert await client.execute("PING") == b"PONG", "an error reply leaves the connection usable"


async def test_concurrent_commands_on_one_connection_each_get_their_own_reply(
    client: PipelinedRedis, server: RedisServer
) -> None:
    replies = await asyncio.gather(*(client.execute("ECHO", f"message {i}") for i in range(300)))
    assert replies == [f"message {i}".encode() for i in range(300)]
    admin = redis.Redis(port=server.port)
    try:
        assert sum(c.get("name") == "pipelined-test" for c in admin.client_list()) == 1
    finally:
        admin.close()


async def test_a_script_runs_by_sha_and_is_loaded_again_after_a_flush(client: PipelinedRedis) -> None:
    script = client.script("return {KEYS[1], ARGV[1], tonumber(ARGV[2]) + 1}")
    assert await script(keys=["k"], args=["v", 41]) == [b"k", b"v", 42]
    await client.execute("SCRIPT", "FLUSH")
    assert await script(keys=["k2"], args=["w", 1]) == [b"k2", b"w", 2]  # NOSCRIPT -> EVAL
    assert await client.execute("SCRIPT", "EXISTS", script.sha) == [1]
    with pytest.raises(ResponseError):
        await client.script("return redis.call('NOSUCHCOMMAND')")()


async def test_a_stalled_redis_times_out_every_command_in_flight_then_recovers(server: RedisServer) -> None:
    client = PipelinedRedis(server.url, timeout_s=0.2)
    try:
        assert await client.execute("PING") == b"PONG"
        _pause(server, 600)
        results = await asyncio.gather(*(client.execute("ECHO", str(i)) for i in range(5)), return_exceptions=True)
        assert all(isinstance(r, TimeoutError) for r in results), results
        await asyncio.sleep(0.6)
        assert await client.execute("ECHO", "after") == b"after"  # a new connection, replies aligned again
    finally:
        await client.aclose()


async def test_a_cancelled_caller_does_not_shift_the_replies_of_the_others(
    client: PipelinedRedis, server: RedisServer
) -> None:
    assert await client.execute("PING") == b"PONG"
    _pause(server, 150)
    first = asyncio.ensure_future(client.execute("ECHO", "first"))
    second = asyncio.ensure_future(client.execute("ECHO", "second"))
    await asyncio.sleep(0.02)
    first.cancel()
    assert await second == b"second"
    assert await client.execute("ECHO", "third") == b"third"


async def test_commands_in_flight_are_bounded(server: RedisServer) -> None:
    client = PipelinedRedis(server.url, timeout_s=2.0, max_in_flight=2)
    try:
        assert await client.execute("PING") == b"PONG"
        _pause(server, 200)
        waiting = [asyncio.ensure_future(client.execute("ECHO", str(i))) for i in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(ConnectionError, match="already in flight"):
            await client.execute("ECHO", "one too many")
        assert await asyncio.gather(*waiting) == [b"0", b"1"]
    finally:
        await client.aclose()


async def test_redis_down_fails_fast_and_the_client_reconnects_once_it_is_back() -> None:
    with redis_server() as srv:
        client = PipelinedRedis(srv.url, timeout_s=1.0)
        try:
            assert await client.execute("SET", "k", "v") == b"OK"
            srv.stop()
            with pytest.raises(ConnectionError):
                await client.execute("GET", "k")  # the connection is gone
            with pytest.raises(ConnectionError, match="cannot connect"):
                await client.execute("GET", "k")  # and nothing listens
            srv.start()
            assert await client.execute("PING") == b"PONG"
        finally:
            await client.aclose()


async def test_password_database_and_client_name_come_from_the_url() -> None:
    with redis_server() as srv:
        admin = redis.Redis(port=srv.port)
        admin.config_set("requirepass", "s3cret")
        admin.close()
        admin = redis.Redis(port=srv.port, password="s3cret", db=3)
        client = PipelinedRedis(f"redis://:s3cret@127.0.0.1:{srv.port}/3", client_name="named")
        wrong = PipelinedRedis(f"redis://:nope@127.0.0.1:{srv.port}/0")
        try:
            assert await client.execute("SET", "in-db-3", "yes") == b"OK"
            assert admin.get("in-db-3") == b"yes"
            assert any(c.get("name") == "named" for c in admin.client_list())
            with pytest.raises(ResponseError):
                await wrong.execute("PING")
        finally:
            admin.close()
            await client.aclose()
            await wrong.aclose()


async def test_nothing_listening_is_a_connection_error_not_a_hang() -> None:
    client = PipelinedRedis(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)
    try:
        with pytest.raises(ConnectionError, match="cannot connect"):
            await asyncio.wait_for(client.execute("PING"), 5)
    finally:
        await client.aclose()
