"""The gateway on Sentinel and Cluster Redis URLs (docs/cache.md, *Deployments*): a real Sentinel in front of a real
redis-server, and a real one-node Redis Cluster. Keys made by `meshserve keys create` authenticate, and
the rate limit counts in that Redis. A malformed URL is a one-line config error (exit code 2)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
from redis.asyncio.cluster import RedisCluster

from services.cli import keys
from services.common import metadata as md
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.gateway.server import redis_client
from services.store.gateway_keys import rate_limit_keys
from tests.helpers import SENTINEL_MASTER, RedisServer, free_port, redis_cluster_node, redis_sentinel
from tests.integration.gateway.conftest import KEYS, StartFn

pytestmark = pytest.mark.integration


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """A Sentinel URL and the port of the master it names."""
    master = RedisServer(port=free_port(), dir=str(tmp_path))
    master.start()
    try:
        with redis_sentinel(master, str(tmp_path)) as port:
            yield f"redis+sentinel://127.0.0.1:{port}/{SENTINEL_MASTER}", master.port
    finally:
        master.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """A Cluster URL and the port of its one node."""
    with redis_cluster_node(str(tmp_path)) as port:
        yield f"redis+cluster://127.0.0.1:{port}", port


async def _generate(stub: inference_pb2_grpc.InferenceStub, key: str) -> grpc.StatusCode:
    call = stub.Generate(
        pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(max_tokens=4)), metadata=((md.API_KEY, key),)
    )
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _create_key(url: str, capsys: pytest.CaptureFixture[str]) -> str:
    """`meshserve keys create` against ``url``; the plaintext key it printed."""
    assert keys.main(["--redis-url", url, "create", "--tenant", "stored"]) == 0
    out = capsys.readouterr().out
    return next(line.split()[-1] for line in out.splitlines() if line.startswith("api key:"))


@pytest.mark.parametrize("kind", ["sentinel", "cluster"])
async def test_gateway_admits_and_limits_through_sentinel_and_cluster(
    kind: str, request: pytest.FixtureRequest, start: StartFn, capsys: pytest.CaptureFixture[str]
) -> None:
    url, port = request.getfixturevalue(kind)
    stored_key = await asyncio.to_thread(_create_key, url, capsys)  # the keys CLI takes the URL too
    # Two requests per tenant, then refusals: the bucket lives in the Redis behind the URL.
    mesh = await start(1, url=url, requests_per_minute=1, request_burst=2, max_concurrent_streams=0)
    stub = mesh.stubs[0]
    codes = [await _generate(stub, KEYS["acme"]) for _ in range(3)]
    assert codes == [grpc.StatusCode.OK, grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert await _generate(stub, stored_key) == grpc.StatusCode.OK  # looked up in that Redis
    direct = redis.Redis(port=port)  # the server behind the URL
    try:
        assert direct.exists(rate_limit_keys("acme").requests) == 1
        assert direct.exists(rate_limit_keys("stored").requests) == 1
    finally:
        direct.close()


@pytest.mark.parametrize(
    ("module", "var", "url"),
    [
        ("services.gateway", "MESHSERVE_GATEWAY_REDIS_URL", "redis+sentinel://127.0.0.1:26379"),
        ("services.gateway", "MESHSERVE_GATEWAY_REDIS_URL", "127.0.0.1:6379"),
        ("services.router", "MESHSERVE_ROUTER_REDIS_URL", "redis+cluster://127.0.0.1:notaport"),
    ],
)
def test_malformed_redis_url_is_a_one_line_config_error(module: str, var: str, url: str) -> None:
    env = {**os.environ, var: url, "MESHSERVE_GATEWAY_API_KEYS": "dev:" + "0" * 64}
    done = subprocess.run(
        [sys.executable, "-m", module], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and var in lines[0] and ("Redis" in lines[0] or "Sentinel" in lines[0]), lines


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:1/0", "redis+sentinel://127.0.0.1:1/mymaster", "redis+cluster://127.0.0.1:1"]
)
async def test_every_kind_of_client_keeps_the_gateways_pool_bound_timeouts_and_name(url: str) -> None:
    client = redis_client(url, 0.25, max_connections=7)
    try:
        if isinstance(client, RedisCluster):
            kwargs = client.nodes_manager.connection_kwargs  # every node's pool is made with these
            assert kwargs["max_connections"] == 7
        else:
            kwargs = client.connection_pool.connection_kwargs
            assert client.connection_pool.max_connections == 7
        assert kwargs["socket_timeout"] == 0.25 and kwargs["socket_connect_timeout"] == 0.25
        assert kwargs["client_name"] == "meshserve-gateway"
    finally:
        await client.aclose()
