"""The official `openai` client's Files and Batch APIs through the front door of the real mesh: upload a
JSONL file, create a batch, poll it, read the output and error files. The batch runner is the one
``Mesh`` starts (``meshserve up``'s topology); lines run on the real model."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import AsyncIterator

import openai
import pytest

from services.controlplane.frontdoor import FrontDoor
from tests.e2e.conftest import API_KEY

pytestmark = pytest.mark.e2e
BOUND_S = 120.0


@pytest.fixture
async def client(door: FrontDoor) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=door.base_url, api_key=API_KEY, max_retries=0) as c:
        yield c


def _line(custom_id: str, body: dict[str, object], url: str = "/v1/chat/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


async def _wait(client: openai.AsyncOpenAI, batch_id: str, statuses: tuple[str, ...]):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + BOUND_S
    while True:
        batch = await client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status} after {BOUND_S:.0f} s"
        await asyncio.sleep(0.3)


async def test_a_chat_batch_runs_to_completion_with_an_error_file(client: openai.AsyncOpenAI) -> None:
    good = [
        _line(f"q{i}", {"messages": [{"role": "user", "content": f"Name colour number {i}."}], "max_tokens": 6})
        for i in range(3)
    ]
    too_many = {"logprobs": True, "top_logprobs": 21}  # above the limit of 20: a 400 naming top_logprobs
    bad = _line("bad", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, **too_many})
    upload = await client.files.create(file=("in.jsonl", io.BytesIO("\n".join([*good, bad]).encode())), purpose="batch")
    assert upload.purpose == "batch" and upload.bytes > 0
    batch = await client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"run": "e2e"}
    )
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"run": "e2e"}
    done = await _wait(client, batch.id, ("completed", "failed", "expired", "cancelled"))
    assert done.status == "completed"
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (4, 3, 1)
    assert done.output_file_id and done.error_file_id

    output = [json.loads(x) for x in (await client.files.content(done.output_file_id)).text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == ["q0", "q1", "q2"]
    for o in output:
        assert o["error"] is None and o["response"]["status_code"] == 200
        body = o["response"]["body"]
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
        assert 0 < body["usage"]["completion_tokens"] <= 6
    (error,) = [json.loads(x) for x in (await client.files.content(done.error_file_id)).text.splitlines()]
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
    assert "logprobs" in error["response"]["body"]["error"]["message"]

    listed = [b.id async for b in client.batches.list(limit=5)]
    assert batch.id in listed
    assert (await client.files.retrieve(done.output_file_id)).purpose == "batch_output"


async def test_a_completions_batch_and_a_bad_input_file(client: openai.AsyncOpenAI) -> None:
    lines = [_line(f"c{i}", {"prompt": f"Count to {i}:", "max_tokens": 4}, "/v1/completions") for i in range(2)]
    upload = await client.files.create(file=("c.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    done = await _wait(client, batch.id, ("completed", "failed", "expired", "cancelled"))
    assert done.status == "completed" and done.error_file_id is None
    output = [json.loads(x) for x in (await client.files.content(done.output_file_id or "")).text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == ["c0", "c1"]
    assert all(o["response"]["body"]["object"] == "text_completion" for o in output)

    # The file's lines name the other endpoint: refused at creation, naming the line.
    with pytest.raises(openai.BadRequestError, match="line 1: 'url' must be"):
        await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    await client.files.delete(upload.id)
    with pytest.raises(openai.NotFoundError):
        await client.files.retrieve(upload.id)
