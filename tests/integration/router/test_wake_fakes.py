"""Holding and waking over real gRPC: a real router (its registry's Sleep and Wake calls, its error mapper and
trailers) over fake workers that play asleep, slow, failing and short-of-memory loads (fake_worker.py). The
same rules over a real edge worker are in test_scale_from_zero.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.errors import ResourceExhausted, Unavailable
from services.common.pb.meshserve.internal.v1 import worker_pb2
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.tokenizer import Tokenizer
from tests.integration.router.fake_worker import FakeWorker
from tests.integration.router.harness import META, Mesh, final, generate, open_mesh, request, tokens

pytestmark = pytest.mark.integration


async def _all_asleep(mesh: Mesh) -> None:
    for worker in mesh.all():
        worker.model_state = worker_pb2.MODEL_STATE_ASLEEP
    await mesh.router.registry.probe_all()  # the router hears it (real workers also heartbeat at once)
    assert not any(r.routable for r in mesh.router.registry.replicas)


async def _models_state(mesh: Mesh) -> str:
    return (await mesh.stub.ListModels(pb.ListModelsRequest(), metadata=META)).models[0].state


def _woken(mesh: Mesh) -> list[FakeWorker]:
    return [w for w in mesh.all() if w.wake_calls]


async def test_64_requests_at_sleeping_workers_are_served_after_one_wake(tokenizer: Tokenizer, redis_url: str) -> None:
    async with open_mesh(tokenizer, redis_url) as mesh:
        await _all_asleep(mesh)
        assert await _models_state(mesh) == "asleep"
        gate = asyncio.Event()
        for worker in mesh.all():
            worker.wake_gate = gate
        calls = [
            asyncio.ensure_future(mesh.stub.Complete(request(f"prompt {i}", max_tokens=3), metadata=META))
            for i in range(64)
        ]
        started = [asyncio.create_task(w.wake_started.wait()) for w in mesh.all()]
        await asyncio.wait(started, return_when=asyncio.FIRST_COMPLETED)
        for task in started:
            task.cancel()
        await mesh.router.registry.probe_all()  # its report says waking now
        assert await _models_state(mesh) == "waking"
        gate.set()
        replies = await asyncio.gather(*calls)
        assert all(r.final.usage.completion_tokens == 3 for r in replies)
        (woken,) = _woken(mesh)
        assert woken.wake_calls == 1
        assert {r.final.route.worker_id for r in replies} == {woken.worker_id}  # only the awake one serves
        assert await _models_state(mesh) == "awake"


async def test_a_wake_short_of_memory_everywhere_is_unavailable_with_a_retry_after(
    tokenizer: Tokenizer, redis_url: str
) -> None:
    async with open_mesh(tokenizer, redis_url) as mesh:
        await _all_asleep(mesh)
        for worker in mesh.all():
            worker.wake_error = ResourceExhausted("not enough memory for the model")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await mesh.stub.Complete(request("hello"), metadata=META)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        details = caught.value.details() or ""
        assert "could not wake up" in details and "short of memory" in details and "retry after" in details
        assert ("retry-after-ms", "5000") in tuple(caught.value.trailing_metadata() or ())
        assert [w.wake_calls for w in mesh.all()] == [1, 1, 1]  # each asleep replica tried once


async def test_a_failed_wake_goes_on_to_another_replica(tokenizer: Tokenizer, redis_url: str) -> None:
    async with open_mesh(tokenizer, redis_url) as mesh:
        await _all_asleep(mesh)
        for worker in mesh.all():
            worker.wake_error = Unavailable("the load failed")
        mesh.edges[1].wake_error = None
        reply = await mesh.stub.Complete(request("hello"), metadata=META)
        assert reply.final.route.worker_id == mesh.edges[1].worker_id
        assert mesh.edges[1].wake_calls == 1


async def test_a_held_request_that_goes_away_cancels_the_wake(tokenizer: Tokenizer, redis_url: str) -> None:
    async with open_mesh(tokenizer, redis_url) as mesh:
        await _all_asleep(mesh)
        for worker in mesh.all():
            worker.wake_gate = asyncio.Event()  # a load that never ends
        call = mesh.stub.Complete(request("hello"), metadata=META)
        started = [asyncio.create_task(w.wake_started.wait()) for w in mesh.all()]
        await asyncio.wait(started, return_when=asyncio.FIRST_COMPLETED)
        for task in started:
            task.cancel()
        call.cancel()
        (woken,) = _woken(mesh)
        await asyncio.wait_for(woken.wake_cancelled.wait(), 10)  # no wake runs for nobody
        assert mesh.router.waker is not None and mesh.router.waker.held == 0


async def test_past_the_wake_deadline_unavailable_names_the_model(tokenizer: Tokenizer, redis_url: str) -> None:
    async with open_mesh(tokenizer, redis_url, wake_deadline_s=0.5) as mesh:
        await _all_asleep(mesh)
        for worker in mesh.all():
            worker.wake_gate = asyncio.Event()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await mesh.stub.Complete(request("hello"), metadata=META)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"model {mesh.router.model_id!r} is waking up" in (caught.value.details() or "")
        assert ("retry-after-ms", "5000") in tuple(caught.value.trailing_metadata() or ())
        (woken,) = _woken(mesh)
        await asyncio.wait_for(woken.wake_cancelled.wait(), 10)


async def test_the_idle_sweeper_puts_replicas_beyond_min_replicas_to_sleep(
    tokenizer: Tokenizer, redis_url: str
) -> None:
    async with open_mesh(tokenizer, redis_url, idle_after_s=0.3, idle_min_replicas=1) as mesh:
        await mesh.stub.Complete(request("hello"), metadata=META)
        slept = [asyncio.create_task(w.slept.wait()) for w in mesh.all()]
        pending, done = set(slept), set[asyncio.Task[bool]]()
        while len(done) < 2:  # two of three, each told once its idle time has passed
            finished, pending = await asyncio.wait(pending, timeout=15, return_when=asyncio.FIRST_COMPLETED)
            assert finished, "the sweeper put fewer than two replicas to sleep"
            done |= finished
        for task in slept:
            task.cancel()
        assert sorted(w.sleep_calls for w in mesh.all()) == [0, 1, 1]  # one stays awake
        assert await _models_state(mesh) == "awake"


async def test_a_stream_whose_only_awake_worker_dies_is_resumed_on_one_woken_for_it(
    tokenizer: Tokenizer, redis_url: str
) -> None:
    async with open_mesh(tokenizer, redis_url) as mesh:
        bypass = pb.RoutingOptions(cache_policy=pb.CACHE_POLICY_BYPASS)
        undisturbed = tokens(await generate(mesh, request("Resume me", 12, routing=bypass)))
        serving, *others = mesh.all()
        for worker in others:
            worker.model_state = worker_pb2.MODEL_STATE_ASLEEP
        await mesh.router.registry.probe_all()
        assert [r.routable for r in mesh.router.registry.replicas].count(True) == 1
        for worker in mesh.all():
            worker.starts.clear()
        serving.die_after_tokens = 5  # the only awake replica fails mid-stream
        frames = await generate(mesh, request("Resume me", 12, routing=bypass))
        fin = final(frames)
        assert tokens(frames) == undisturbed  # held while another woke, then resumed there: no gap, no repeat
        assert fin.route.reason.startswith("failover") and fin.usage.completion_tokens == 12
        (woken,) = _woken(mesh)
        assert woken is not serving and fin.route.worker_id == woken.worker_id
        assert [list(s.resume_token_ids) for s in woken.starts] == [undisturbed[:5]]
