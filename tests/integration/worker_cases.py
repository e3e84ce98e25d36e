"""Behaviour every worker tier must have, run against the real model by each tier's test class.

A subclass provides the fixtures ``stub`` (a WorkerStub to a running worker), ``reference`` (the
same model called directly: ``reference(ids, n) -> greedy ids``, trailing EOS dropped) and
``prompt`` (token ids of a short chat prompt).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import pytest

from services.common.pb.meshserve.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from tests.worker_helpers import CANCEL, META, Session, fold, generate, start_frame, stats, wait_idle, wait_serving

Reference = Callable[[list[int], int], list[int]]
N = 12


class WorkerCases:
    async def test_greedy_equals_the_model_called_directly(
        self, stub: worker_pb2_grpc.WorkerStub, reference: Reference, prompt: list[int], tokenizer: object
    ) -> None:
        result = await generate(stub, prompt, max_tokens=N)
        expected = await asyncio.to_thread(reference, prompt, N)
        assert result.token_ids == expected
        assert result.text == tokenizer.decode(expected)  # type: ignore[attr-defined]
        assert result.reason == (pb.FINISH_REASON_LENGTH if len(expected) == N else pb.FINISH_REASON_STOP)
        assert result.sequences == list(range(len(expected) + 1))
        again = await generate(stub, prompt, max_tokens=N)
        assert again.token_ids == result.token_ids

    async def test_resumed_stream_continues_exactly_like_the_undisturbed_run(
        self, stub: worker_pb2_grpc.WorkerStub, prompt: list[int]
    ) -> None:
        full = await generate(stub, prompt, max_tokens=24)
        k = 9  # tokens another worker already sent before it died

        async def requests() -> AsyncIterator[worker_pb2.WorkerRequest]:
            frame = start_frame(prompt, max_tokens=24)
            frame.start.resume_token_ids.extend(full.token_ids[:k])
            yield frame

        resumed = fold([f async for f in stub.Generate(requests(), metadata=META)])
        assert resumed.token_ids == full.token_ids[k:]  # only the new tokens, none repeated or missing
        assert resumed.final is not None and resumed.final.prompt_tokens == len(prompt) + k

    async def test_json_cut_by_its_budget_is_closed_valid_and_a_resumed_stream_closes_the_same(
        self, stub: worker_pb2_grpc.WorkerStub, tokenizer: object
    ) -> None:
        """The budget-closing mask on the real engine: a JSON answer that would run past max_tokens ends
        valid, with EOS inside the budget, marked budget_closed on the wire; resumed mid-way (a failover),
        the stream continues to the same closed answer."""
        text = {"type": "object", "properties": {"description": {"type": "string"}}, "required": ["description"]}
        ask = "<|im_start|>user\nDescribe the solar system in detail as JSON.<|im_end|>\n<|im_start|>assistant\n"
        ids = list(tokenizer.encode(ask).ids)  # type: ignore[attr-defined]
        sampling = {"max_tokens": 16, "structured": pb.StructuredOutput(json_schema=json.dumps(text))}
        result = await generate(stub, ids, **sampling)
        assert result.final is not None and result.final.budget_closed, result.text
        assert result.reason == pb.FINISH_REASON_STOP and result.final.completion_tokens <= 16
        assert isinstance(json.loads(result.text)["description"], str)

        async def requests() -> AsyncIterator[worker_pb2.WorkerRequest]:
            frame = start_frame(ids, **sampling)
            frame.start.resume_token_ids.extend(result.token_ids[:10])
            yield frame

        resumed = fold([f async for f in stub.Generate(requests(), metadata=META)])
        assert result.token_ids[:10] + resumed.token_ids == result.token_ids
        assert resumed.final is not None and resumed.final.budget_closed

    async def test_max_tokens_is_length(self, stub: worker_pb2_grpc.WorkerStub, prompt: list[int]) -> None:
        result = await generate(stub, prompt, max_tokens=3)
        assert len(result.token_ids) == 3 and result.reason == pb.FINISH_REASON_LENGTH
        assert (result.final.prompt_tokens, result.final.completion_tokens) == (len(prompt), 3)  # type: ignore[union-attr]

    async def test_stop_string_split_across_tokens(
        self, stub: worker_pb2_grpc.WorkerStub, prompt: list[int], tokenizer: object
    ) -> None:
        full = await generate(stub, prompt, max_tokens=N)
        decode = tokenizer.decode  # type: ignore[attr-defined]
        boundary = len(decode(full.token_ids[:4]))
        stop = full.text[boundary - 2 : boundary + 2]  # straddles the 4th/5th token boundary
        result = await generate(stub, prompt, max_tokens=N, stop=[stop])
        assert result.reason == pb.FINISH_REASON_STOP_STRING
        assert result.text == full.text[: full.text.index(stop)]
        assert stop not in result.text

    async def test_seeded_sampling_is_reproducible(self, stub: worker_pb2_grpc.WorkerStub, prompt: list[int]) -> None:
        params = {"max_tokens": 8, "temperature": 1.0, "top_p": 0.95, "top_k": 50}
        first = await generate(stub, prompt, seed=1234, **params)
        second = await generate(stub, prompt, seed=1234, **params)
        assert first.token_ids == second.token_ids and first.text == second.text
        other = await generate(stub, prompt, seed=99, **params)
        assert other.token_ids != first.token_ids

    async def test_cancel_frame_stops_generation(self, stub: worker_pb2_grpc.WorkerStub, prompt: list[int]) -> None:
        before = await stats(stub)
        session = Session(stub)
        await session.call.write(start_frame(prompt, max_tokens=400))
        await session.read()
        await session.call.write(CANCEL)
        while not (frame := await session.read()).HasField("final"):
            pass
        assert frame.final.finish_reason == pb.FINISH_REASON_CANCELLED
        settled = await stats(stub)
        assert settled.active_sequences == 0
        assert settled.sequences_cancelled_total == before.sequences_cancelled_total + 1
        assert settled.tokens_generated_total - before.tokens_generated_total < 150  # of max_tokens=400
        await session.call.done_writing()
        assert await session.call.read() is grpc.aio.EOF
        await asyncio.sleep(0.3)  # observing that nothing more happens
        assert (await stats(stub)).tokens_generated_total == settled.tokens_generated_total

    async def test_closing_the_stream_stops_generation(
        self, stub: worker_pb2_grpc.WorkerStub, prompt: list[int]
    ) -> None:
        before = await stats(stub)
        session = Session(stub)
        await session.call.write(start_frame(prompt, max_tokens=400))
        await session.read()
        session.call.cancel()
        settled = await wait_idle(stub)
        assert settled.sequences_cancelled_total == before.sequences_cancelled_total + 1
        # Stops long before max_tokens (400). How many steps a cancel takes is a benchmark number,
        # not a test threshold: on a loaded 2-core CI box a few dozen tokens can pass first.
        assert settled.tokens_generated_total - before.tokens_generated_total < 150
        await asyncio.sleep(0.3)  # observing that nothing more happens
        assert (await stats(stub)).tokens_generated_total == settled.tokens_generated_total

    async def test_two_turns_on_one_stream(
        self, stub: worker_pb2_grpc.WorkerStub, reference: Reference, prompt: list[int]
    ) -> None:
        session = Session(stub)
        first = await session.turn(prompt, max_tokens=4)
        context = [*prompt, *first.token_ids, *prompt[-3:]]
        second = await session.turn(context, max_tokens=4)
        await session.call.done_writing()
        assert await session.call.read() is grpc.aio.EOF
        assert second.sequences[0] == 0
        assert second.final.prompt_tokens == len(context)  # type: ignore[union-attr]
        assert second.token_ids == await asyncio.to_thread(reference, context, 4)

    async def test_stats(self, stub: worker_pb2_grpc.WorkerStub) -> None:
        current = await stats(stub)
        assert current.model == "smollm2-135m-instruct" and current.max_active_sequences == 2
        assert current.sequences_started_total > 0 and current.prefill_tokens_total > 0

    async def test_missing_internal_token_is_permission_denied(self, stub: worker_pb2_grpc.WorkerStub) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Stats(worker_pb2.StatsRequest())
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED

    @pytest.mark.parametrize(
        ("ids", "max_tokens", "needle"),
        [([], 4, "empty"), ([1, 49152], 4, "out of range"), ([1, 2, 3], 8192, "max_tokens")],
    )
    async def test_bad_input_is_invalid_argument(
        self, stub: worker_pb2_grpc.WorkerStub, ids: list[int], max_tokens: int, needle: str
    ) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(stub, ids, max_tokens=max_tokens)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in (info.value.details() or "")


async def run_as_process(module: str, prefix: str, **env: str) -> None:
    """``python -m <module>``: learn the port from `service_started`, wait on health, one call, SIGTERM."""
    environ = {**os.environ, f"{prefix}PORT": "0", f"{prefix}THREADS": "1", f"{prefix}SHUTDOWN_GRACE_S": "2", **env}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, env=environ, stderr=asyncio.subprocess.PIPE
    )
    assert proc.stderr is not None
    try:
        port = None
        while port is None:
            line = await asyncio.wait_for(proc.stderr.readline(), 120)
            assert line, f"{module} exited before serving"
            if b'"service_started"' in line:
                port = int(json.loads(line)["port"])
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await wait_serving(channel)
            result = await generate(worker_pb2_grpc.WorkerStub(channel), [1, 504, 3458, 282], max_tokens=2)
            assert len(result.token_ids) == 2
        proc.send_signal(signal.SIGTERM)
        rest = await asyncio.wait_for(proc.stderr.read(), 60)
        assert await proc.wait() == 0, rest.decode(errors="replace")[-2000:]
        assert b'"service_stopped"' in rest
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@dataclass
class SleepingWorker:
    """A worker process (:func:`sleeping_worker`): its stub and the events of its log lines so far."""

    stub: worker_pb2_grpc.WorkerStub
    events: list[str] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def count(self, event: str) -> int:
        return self.events.count(event)

    async def wait_count(self, event: str, n: int, timeout_s: float = 60.0) -> None:
        """Until ``event`` was logged ``n`` times (its line may come after the reply it caused)."""
        async with asyncio.timeout(timeout_s):
            while self.count(event) < n:
                self._changed.clear()
                await self._changed.wait()


@contextlib.asynccontextmanager
async def sleeping_worker(module: str, prefix: str, **env: str) -> AsyncIterator[SleepingWorker]:
    """``python -m <module>`` in its own process (its resident memory is the worker's alone), serving;
    its JSON log lines' events are collected. SIGTERM at the end."""
    environ = {**os.environ, f"{prefix}PORT": "0", f"{prefix}THREADS": "1", f"{prefix}SHUTDOWN_GRACE_S": "2", **env}
    environ[f"{prefix}LOG_JSON"] = "true"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, env=environ, stderr=asyncio.subprocess.PIPE
    )
    assert proc.stderr is not None
    reader: asyncio.Task[None] | None = None
    try:
        port = None
        while port is None:
            line = await asyncio.wait_for(proc.stderr.readline(), 180)
            assert line, f"{module} exited before serving"
            if b'"service_started"' in line:
                port = int(json.loads(line)["port"])
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await wait_serving(channel, timeout_s=120)
            worker = SleepingWorker(worker_pb2_grpc.WorkerStub(channel))

            async def read(stream: asyncio.StreamReader) -> None:
                async for raw in stream:
                    with contextlib.suppress(ValueError):
                        worker.events.append(str(json.loads(raw).get("event", "")))
                        worker._changed.set()

            reader = asyncio.create_task(read(proc.stderr))
            yield worker
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 60)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if reader is not None:
            reader.cancel()
