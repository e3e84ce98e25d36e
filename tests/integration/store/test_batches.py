"""The batch store against a real redis-server: quotas, tenant isolation, exactly-once results,
reclaiming a dead consumer's entries, and the sweep's expiry, cancel and re-queue."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from services.common.errors import InvalidArgument, NotFound, ResourceExhausted
from services.store.batches import BatchStore, parse_input, window_seconds
from services.store.files import FileStore

pytestmark = pytest.mark.integration
CHAT = "/v1/chat/completions"


def jsonl(n: int, url: str = CHAT) -> bytes:
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": url, "body": {"messages": [{"role": "user", "content": "hi"}]}}
        for i in range(n)
    ]
    return "\n".join(json.dumps(x) for x in lines).encode()


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[BatchStore]:
    client = aioredis.Redis.from_url(redis_url)
    s = BatchStore(client)
    await s.ensure_group()
    yield s
    await client.aclose()


async def make(store: BatchStore, tenant: str, n: int, limit: int = 0, window_s: int = 3600):  # type: ignore[no-untyped-def]
    lines = parse_input(jsonl(n), CHAT, max_lines=100)
    return await store.create(
        tenant,
        input_file_id="file-x",
        endpoint=CHAT,
        completion_window="1h",
        window_s=window_s,
        metadata={"k": "v"},
        lines=lines,
        lines_limit=limit,
    )


def test_parse_input_names_the_bad_line() -> None:
    with pytest.raises(InvalidArgument, match="line 2 of the input file is not valid JSON"):
        parse_input(
            b'{"custom_id":"a","method":"POST","url":"/v1/completions","body":{}}\n{oops',
            "/v1/completions",
            max_lines=5,
        )
    with pytest.raises(InvalidArgument, match="used twice"):
        parse_input(jsonl(1) + b"\n" + jsonl(1), CHAT, max_lines=5)
    with pytest.raises(InvalidArgument, match="'url' must be"):
        parse_input(jsonl(1, "/v1/completions"), CHAT, max_lines=5)
    with pytest.raises(InvalidArgument, match="more than 2 requests"):
        parse_input(jsonl(3), CHAT, max_lines=2)
    assert window_seconds("24h", 86400) == 86400
    with pytest.raises(InvalidArgument, match="completion_window"):
        window_seconds("2d", 86400)


async def test_files_quota_and_isolation(store: BatchStore) -> None:
    files: FileStore = store.files
    f = await files.create("acme", "in.jsonl", "batch", b"x" * 100, limit_bytes=150)
    assert (await files.get("acme", f.id)).bytes == 100
    assert [len(p) async for p in files.pieces("acme", f.id, 40)] == [40, 40, 20]  # a large file is never one reply
    with pytest.raises(ResourceExhausted, match="storage quota"):
        await files.create("acme", "more.jsonl", "batch", b"x" * 100, limit_bytes=150)
    with pytest.raises(NotFound):
        await files.get("other", f.id)  # another tenant's file does not exist for it
    with pytest.raises(NotFound):
        await files.content("other", f.id)
    assert [x.id for x in (await files.page("acme"))[0]] == [f.id]
    assert (await files.page("other"))[0] == []
    await files.delete("acme", f.id)
    assert await files.used_bytes("acme") == 0


async def test_results_are_written_once_and_the_batch_completes(store: BatchStore) -> None:
    batch = await make(store, "acme", 3)
    assert batch.status == "in_progress" and batch.total == 3
    items = await store.read("runner-a", 10, 100)
    assert sorted(i.index for i in items) == [0, 1, 2]
    results = []
    for item in items:
        results.append(
            await store.record(item, f"r{item.index}", item.index != 1, json.dumps({"custom_id": f"r{item.index}"}))
        )
        assert await store.record(item, f"r{item.index}", True, "again") == "duplicate"
        await store.ack(item)
    assert results[-1] == "last"
    done = await store.finalize("acme", batch.id)
    assert done.status == "completed" and (done.completed, done.failed) == (2, 1)
    out = await store.files.content("acme", done.output_file_id)
    assert [json.loads(x)["custom_id"] for x in out.splitlines()] == ["r0", "r2"]
    assert [
        json.loads(x)["custom_id"] for x in (await store.files.content("acme", done.error_file_id)).splitlines()
    ] == ["r1"]
    with pytest.raises(NotFound):
        await store.get("other", batch.id)
    # the quota of lines in flight is given back when the batch ends
    await make(store, "acme", 3, limit=3)


async def test_lines_quota(store: BatchStore) -> None:
    await make(store, "acme", 3, limit=4)
    with pytest.raises(ResourceExhausted, match="batch quota"):
        await make(store, "acme", 2, limit=4)


async def test_a_dead_consumers_entries_are_reclaimed(store: BatchStore) -> None:
    await make(store, "acme", 2)
    held = await store.read("dead", 10, 100)
    assert len(held) == 2
    assert (await store.reclaim("alive", 60_000, 10))[1] == []  # not idle long enough
    cursor, first = await store.reclaim("alive", 0, 1)
    cursor, second = await store.reclaim("alive", 0, 1, cursor)
    assert sorted(i.index for i in first + second) == [0, 1]


async def test_a_lost_work_stream_is_made_again_and_runners_go_on(store: BatchStore, redis_url: str) -> None:
    """Redis restarted without persistence (or flushed): XREADGROUP / XAUTOCLAIM answer NOGROUP; the store
    creates the stream and its group again instead of failing every read."""
    from services.store.keys import BATCH_WORK_STREAM

    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.delete(BATCH_WORK_STREAM)
    finally:
        await client.aclose()
    assert await store.read("r1", 10, 10) == []
    await store.ensure_group()  # already there again: BUSYGROUP is fine
    assert await store.reclaim("r1", 0, 10) == ("0-0", [])
    await make(store, "acme", 1)
    assert [i.index for i in await store.read("r1", 10, 100)] == [0]


async def test_sweep_expires_cancels_and_requeues(store: BatchStore, redis_url: str) -> None:
    expiring = await make(store, "acme", 2, window_s=0)
    item = (await store.read("r", 1, 100))[0]
    await store.record(item, f"r{item.index}", True, json.dumps({"custom_id": f"r{item.index}"}))
    cancelled = await make(store, "acme", 2)
    assert (await store.cancel("acme", cancelled.id)).status == "cancelling"
    assert (await store.cancel("acme", cancelled.id)).status == "cancelling"
    stuck = await make(store, "acme", 1)
    client = aioredis.Redis.from_url(redis_url)
    await client.hset(store._key("acme", stuck.id), "status", "validating")  # its creator died before queueing
    await client.aclose()
    await store.sweep(
        requeue_after_s=0,
        cancel_grace_s=0,
        stuck_after_s=0,
        expired_line='{"custom_id": "{custom_id}", "error": {"code": "batch_expired"}}',
    )
    e = await store.get("acme", expiring.id)
    assert e.status == "expired" and e.output_file_id and e.error_file_id
    assert json.loads(await store.files.content("acme", e.error_file_id))["error"]["code"] == "batch_expired"
    assert (await store.get("acme", cancelled.id)).status == "cancelled"
    assert (await store.get("acme", stuck.id)).status == "in_progress"
    with pytest.raises(InvalidArgument, match="only a validating or in_progress"):
        await store.cancel("acme", e.id)
