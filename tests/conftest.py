"""Fixtures shared by all tests: a real redis-server per session, flushed per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from tests.helpers import RedisServer, redis_server


@pytest.fixture(scope="session")
def redis_srv() -> Iterator[RedisServer]:
    """One real redis-server for the whole session (loopback, no persistence)."""
    with redis_server() as server:
        yield server


@pytest.fixture
def redis_url(redis_srv: RedisServer) -> Iterator[str]:
    """URL of the session's Redis, emptied before each test."""
    client = redis.Redis.from_url(redis_srv.url)
    client.flushall()
    client.close()
    yield redis_srv.url
