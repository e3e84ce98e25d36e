"""/v1/files and /v1/batches with the official `openai` client through Envoy, the adapter and a real
gateway, a batch runner in this process and the fake router: results, the error file, tenant
isolation, quotas, cancel, and the clear 400/404 of bad input."""

from __future__ import annotations

import asyncio
import io
import json
import sys
import time
from asyncio.subprocess import PIPE
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import openai
import pytest
import redis.asyncio as aioredis

from services.batch.capacity import Capacity
from services.batch.config import BatchSettings
from services.batch.runner import Runner
from services.common import metadata as md
from services.common.pb.meshserve.internal.v1 import router_admin_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.store.batches import BatchStore
from tests.helpers import RedisServer
from tests.integration.frontdoor.conftest import (
    API_KEY,
    INTERNAL_TOKEN,
    LIMITED_KEY,
    MODEL,
    TINY_KEY,
    WORDS,
    FakeRouter,
    Stack,
)

pytestmark = pytest.mark.integration
CHAT = "/v1/chat/completions"


def _jsonl(n: int, body: dict[str, object] | None = None, prefix: str = "r") -> io.BytesIO:
    body = body or {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    lines = [json.dumps({"custom_id": f"{prefix}{i}", "method": "POST", "url": CHAT, "body": body}) for i in range(n)]
    return io.BytesIO("\n".join(lines).encode())


class _Database7:
    """The session's redis-server, database 7: the batch work stream here is this module's alone (the
    e2e session mesh keeps database 1, and other tests flush database 0 between tests)."""

    def __init__(self, server: RedisServer) -> None:
        self._server = server

    @property
    def url(self) -> str:
        return self._server.url.rsplit("/", 1)[0] + "/7"


@pytest.fixture(scope="module")
def redis_srv(redis_srv: RedisServer) -> _Database7:  # the stack's and the runner's Redis
    return _Database7(redis_srv)


@pytest.fixture
async def client(stack: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=stack.door.base_url, api_key=API_KEY, max_retries=0) as c:
        yield c


@pytest.fixture
async def tiny(stack: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=stack.door.base_url, api_key=TINY_KEY, max_retries=0) as c:
        yield c


@pytest.fixture
async def runner(stack: Stack, redis_srv: RedisServer) -> AsyncIterator[Runner]:
    """A batch runner calling the fake router (which has no RouterAdmin: one line at a time)."""
    settings = BatchSettings(
        redis_url=redis_srv.url,
        router_addresses=f"127.0.0.1:{stack.servers[0].port}",
        internal_token=INTERNAL_TOKEN,
        sweep_interval_s=0.2,
        cancel_grace_s=0,
        shutdown_grace_s=1,
    )
    redis = aioredis.Redis.from_url(redis_srv.url)
    channel = grpc.aio.insecure_channel(settings.routers()[0])
    capacity = Capacity(
        [router_admin_pb2_grpc.RouterAdminStub(channel)],
        ((md.INTERNAL_TOKEN, INTERNAL_TOKEN),),
        max_in_flight=2,
        reserve_slots=0,
        poll_s=0.2,
    )
    running = Runner(settings, BatchStore(redis), [inference_pb2_grpc.InferenceStub(channel)], capacity)
    task = asyncio.create_task(running.run())
    yield running
    running.stop()
    await asyncio.wait_for(task, 10)
    await channel.close()
    await redis.aclose()


async def _until(client: openai.AsyncOpenAI, batch_id: str, *statuses: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 30
    while (batch := await client.batches.retrieve(batch_id)).status not in statuses:
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        await asyncio.sleep(0.1)
    return batch


async def test_results_once_per_line_and_tenants_see_only_their_own(
    client: openai.AsyncOpenAI, tiny: openai.AsyncOpenAI, runner: Runner, router: FakeRouter
) -> None:
    upload = await client.files.create(file=("in.jsonl", _jsonl(3)), purpose="batch")
    batch = await client.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    done = await _until(client, batch.id, "completed")
    assert done.request_counts is not None and done.request_counts.completed == 3
    output = [json.loads(x) for x in (await client.files.content(done.output_file_id or "")).text.splitlines()]
    assert [o["custom_id"] for o in output] == ["r0", "r1", "r2"]  # in input order
    assert {o["response"]["body"]["choices"][0]["message"]["content"] for o in output} == {"".join(WORDS)}
    assert all(r.turn.routing.priority == 0 for r in router.requests)  # type: ignore[attr-defined]
    # Another tenant: no such file, no such batch, empty lists.
    with pytest.raises(openai.NotFoundError):
        await tiny.files.retrieve(upload.id)
    with pytest.raises(openai.NotFoundError):
        await tiny.files.content(done.output_file_id or "")
    with pytest.raises(openai.NotFoundError):
        await tiny.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        await tiny.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    assert [b.id async for b in tiny.batches.list()] == []
    assert upload.id not in [f.id async for f in tiny.files.list()]


async def test_bad_lines_go_to_the_error_file(client: openai.AsyncOpenAI, runner: Runner) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}
    upload = await client.files.create(file=("in.jsonl", _jsonl(1, body, "big")), purpose="batch")
    batch = await client.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    done = await _until(client, batch.id, "completed")
    assert done.output_file_id is None and done.request_counts is not None and done.request_counts.failed == 1
    (line,) = (await client.files.content(done.error_file_id or "")).text.splitlines()
    error = json.loads(line)
    assert error["custom_id"] == "big0" and error["response"]["status_code"] == 400
    assert "max_tokens" in error["error"]["message"]


async def test_quota_and_bad_requests_are_clear(client: openai.AsyncOpenAI, tiny: openai.AsyncOpenAI) -> None:
    upload = await tiny.files.create(file=("in.jsonl", _jsonl(4)), purpose="batch")
    with pytest.raises(openai.RateLimitError, match=r"batch quota reached: 0 lines .* the limit is 3"):
        await tiny.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="purpose 'fine-tune' is not supported"):
        await client.files.create(file=("in.jsonl", _jsonl(1)), purpose="fine-tune")
    bad = await client.files.create(file=("bad.jsonl", io.BytesIO(b'{"custom_id": "a"\n')), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="line 1 of the input file is not valid JSON"):
        await client.batches.create(input_file_id=bad.id, endpoint=CHAT, completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        await client.batches.create(input_file_id=bad.id, endpoint=CHAT, completion_window="2d")  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="endpoint '/v1/embeddings' is not supported"):
        await client.batches.create(input_file_id=bad.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.NotFoundError, match="no batch with id"):
        await client.batches.retrieve("batch_nope")
    with pytest.raises(openai.BadRequestError, match="not an id this server gave out"):
        await client.batches.retrieve("batch_$$$")


async def test_a_key_limited_to_models_may_batch_only_those(stack: Stack) -> None:
    """The runner calls with its own credential: a key's model limit is checked when the batch is made."""
    async with openai.AsyncOpenAI(base_url=stack.door.base_url, api_key=LIMITED_KEY, max_retries=0) as limited:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        for body in ({**chat, "model": MODEL}, chat):  # another model, or none (the default is not known)
            upload = await limited.files.create(file=("in.jsonl", _jsonl(2, body)), purpose="batch")
            with pytest.raises(openai.PermissionDeniedError, match=r"request 1 \('r0'\): .* may use other-model"):
                await limited.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
        upload = await limited.files.create(
            file=("ok.jsonl", _jsonl(2, {**chat, "model": "other-model"})), purpose="batch"
        )
        made = await limited.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
        await limited.batches.cancel(made.id)


async def test_cancel(client: openai.AsyncOpenAI, redis_srv: RedisServer) -> None:
    upload = await client.files.create(file=("in.jsonl", _jsonl(2)), purpose="batch")
    batch = await client.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    cancelling = await client.batches.cancel(batch.id)  # no runner here: nothing has run
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    redis = aioredis.Redis.from_url(redis_srv.url)
    await BatchStore(redis).sweep(requeue_after_s=60, cancel_grace_s=0, stuck_after_s=60, expired_line="")
    await redis.aclose()
    cancelled = await client.batches.retrieve(batch.id)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at and cancelled.output_file_id is None
    with pytest.raises(openai.BadRequestError, match="only a validating or in_progress batch"):
        done = await client.files.create(file=("in.jsonl", _jsonl(1)), purpose="batch")
        finished = await client.batches.create(input_file_id=done.id, endpoint=CHAT, completion_window="24h")
        redis = aioredis.Redis.from_url(redis_srv.url)
        await redis.hset(BatchStore._key("acme", finished.id), "status", "completed")
        await redis.aclose()
        await client.batches.cancel(finished.id)


async def test_lines_wait_out_a_mesh_with_no_worker(
    client: openai.AsyncOpenAI, runner: Runner, router: FakeRouter
) -> None:
    router.mode = "unavailable"  # as a router with no healthy worker answers
    upload = await client.files.create(file=("in.jsonl", _jsonl(2, prefix="u")), purpose="batch")
    batch = await client.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    await asyncio.sleep(2.5)  # more than MAX_ATTEMPTS runs of each line, had they been counted
    waiting = await client.batches.retrieve(batch.id)
    assert waiting.status == "in_progress" and waiting.request_counts is not None
    assert (waiting.request_counts.completed, waiting.request_counts.failed) == (0, 0)
    router.mode = "ok"
    done = await _until(client, batch.id, "completed")
    assert done.request_counts is not None and (done.request_counts.completed, done.request_counts.failed) == (2, 0)


async def _cli(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "batch", *args, stdout=PIPE, stderr=PIPE
    )
    out, err = await proc.communicate()
    return int(proc.returncode or 0), out.decode(), err.decode()


async def test_the_cli_submits_waits_and_prints_the_results(stack: Stack, runner: Runner, tmp_path: Path) -> None:
    requests = tmp_path / "in.jsonl"
    requests.write_bytes(_jsonl(2, prefix="cli").getvalue())
    where = ("--address", stack.gateway_address, "--api-key", API_KEY)
    code, out, err = await _cli(*where, "submit", str(requests), "--wait")
    assert code == 0, err
    batch_id = out.strip()
    assert batch_id.startswith("batch_") and "completed: 2/2 completed, 0 failed" in err and "line/s" in err  # the bar
    code, out, err = await _cli(*where, "results", batch_id)
    assert code == 0, err
    assert [json.loads(x)["custom_id"] for x in out.splitlines()] == ["cli0", "cli1"]
    code, out, err = await _cli(*where, "results", batch_id, "--errors")
    assert code == 1 and "has no error file" in err
    code, out, err = await _cli(*where, "cancel", "batch_nope")
    assert code == 1 and "NOT_FOUND: no batch with id 'batch_nope'" in err
