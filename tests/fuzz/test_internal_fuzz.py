"""Fuzz the mesh's internal APIs (router admin and registry, cache admin, the worker's Stats, KV
import/export and its Generate stream) with messages built from their descriptors.

Only mesh services and operators' CLIs call these, but a bad or hostile caller inside the network (or a
buggy service) must get a clear answer too. Properties of every case, as for the public API: the call
ends within ``CASE_TIMEOUT_S``; its status is OK or one of ``ALLOWED`` (never INTERNAL or UNKNOWN);
error details are one line without traceback text; and after the test every service is SERVING and no
service logged an error (conftest).

Metadata is mostly the internal credential, sometimes none or junk (PERMISSION_DENIED). Heartbeats come
from addresses the strategies make up (the router adds them, probes them and forgets them) and may say
``leaving``; Cache.Flush really flushes the fuzz mesh's caches; Cache.Warm sends its prompts through the
router, so its lists are kept short; a Warm that outlasts ``WARM_TIMEOUT_S`` is abandoned, and the worker
must then stop generating for it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message
from hypothesis import given
from hypothesis import strategies as st

from services.common.config import DEFAULT_INTERNAL_TOKEN
from services.common.pb.meshserve.internal.v1 import cache_pb2, registry_pb2, router_admin_pb2, worker_pb2
from services.local.mesh import Mesh
from tests.fuzz.conftest import examples, record
from tests.fuzz.strategies import message
from tests.fuzz.test_grpc_fuzz import check_error, local_write_race

pytestmark = pytest.mark.fuzz

CASE_TIMEOUT_S = 60.0
# A Warm's prompts are real generation requests (up to the model's context, up to 256 tokens each), so
# a drawn case can outlast any fixed deadline; past this one the caller gives up, and the worker must
# then stop generating for it within IDLE_WAIT_S.
WARM_TIMEOUT_S = 10.0
IDLE_WAIT_S = 10.0
INTERNAL = (("x-meshserve-internal-token", DEFAULT_INTERNAL_TOKEN),)
_ascii = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=100)
METADATA = st.one_of(
    st.just(INTERNAL),
    st.just(INTERNAL),
    st.just(INTERNAL),
    st.just(()),
    st.tuples(st.tuples(st.just("x-meshserve-internal-token"), _ascii)),
)


def _method(service: Any, name: str) -> MethodDescriptor:
    method: MethodDescriptor = service.methods_by_name[name]
    assert not method.client_streaming and not method.server_streaming, method.full_name
    return method


ROUTER = (
    registry_pb2.DESCRIPTOR.services_by_name["WorkerRegistry"],
    router_admin_pb2.DESCRIPTOR.services_by_name["RouterAdmin"],
)
CACHE = cache_pb2.DESCRIPTOR.services_by_name["Cache"]
WORKER = worker_pb2.DESCRIPTOR.services_by_name["Worker"]
# (which process, method): every unary internal method the fuzz mesh serves.
METHODS = [
    ("router", _method(ROUTER[0], "Heartbeat")),
    ("router", _method(ROUTER[1], "ListReplicas")),
    ("router", _method(ROUTER[1], "PrefixLocation")),
    ("cache", _method(CACHE, "Stats")),
    ("cache", _method(CACHE, "Flush")),
    ("cache", _method(CACHE, "Warm")),
    ("edge", _method(WORKER, "Stats")),
    ("edge", _method(WORKER, "ImportKV")),
    ("edge", _method(WORKER, "ExportKV")),
]


def _request(method: MethodDescriptor) -> st.SearchStrategy[Message]:
    strategy = message(method.input_type)
    if method.input_type is cache_pb2.WarmRequest.DESCRIPTOR:  # each prompt is a real request
        return strategy.map(lambda r: cache_pb2.WarmRequest(prompts=r.prompts[:2], max_tokens=r.max_tokens))
    return strategy


CASES = st.sampled_from(METHODS).flatmap(lambda m: st.tuples(st.just(m), _request(m[1])))


def _address(mesh: Mesh, where: str) -> str:
    if where == "router":
        return mesh.router_address
    if where == "cache":
        return mesh.cache_address
    return mesh.workers("edge")[0].address


@examples(60)
@given(case=CASES, metadata=METADATA)
async def test_internal_unary_methods(
    fuzz_mesh: Mesh, case: tuple[tuple[str, MethodDescriptor], Message], metadata: tuple[tuple[str, str], ...]
) -> None:
    (where, method), request = case
    test = f"internal.{method.containing_service.name}.{method.name}"
    response_class = message_factory.GetMessageClass(method.output_type)
    async with grpc.aio.insecure_channel(_address(fuzz_mesh, where)) as channel:
        call = channel.unary_unary(
            f"/{method.containing_service.full_name}/{method.name}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=response_class.FromString,
        )
        warm = method.name == "Warm"
        timeout = WARM_TIMEOUT_S if warm else CASE_TIMEOUT_S
        try:
            await call(request, metadata=metadata, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if warm and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                record(test, exc.code().name)
                await _worker_idle(fuzz_mesh, test)
                return
            assert exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED, f"{test}: no answer in {timeout:.0f} s"
            check_error(test, exc)
            return
    record(test, "OK")


async def _worker_idle(mesh: Mesh, test: str) -> None:
    """A Warm whose caller gave up must not keep the worker generating: its cancel reaches the engine."""
    async with grpc.aio.insecure_channel(mesh.workers("edge")[0].address) as channel:
        stats = channel.unary_unary(
            "/meshserve.internal.v1.Worker/Stats",
            request_serializer=worker_pb2.StatsRequest.SerializeToString,
            response_deserializer=worker_pb2.WorkerStats.FromString,
        )
        loop = asyncio.get_running_loop()
        until = loop.time() + IDLE_WAIT_S
        while (reply := await stats(worker_pb2.StatsRequest(), metadata=INTERNAL, timeout=5)).active_sequences:
            assert loop.time() < until, f"{test}: the worker still runs {reply.active_sequences} sequences"
            await asyncio.sleep(0.1)


WORKER_FRAMES = st.one_of(
    st.lists(message(worker_pb2.WorkerRequest.DESCRIPTOR), min_size=1, max_size=3),
    st.builds(
        lambda start, rest: [worker_pb2.WorkerRequest(start=start), *rest],
        message(worker_pb2.WorkerStart.DESCRIPTOR),
        st.lists(message(worker_pb2.WorkerRequest.DESCRIPTOR), max_size=2),
    ),
)


@examples(40)
@given(frames=WORKER_FRAMES, metadata=METADATA, half_close=st.booleans())
async def test_worker_generate_stream(
    fuzz_mesh: Mesh, frames: list[worker_pb2.WorkerRequest], metadata: tuple[tuple[str, str], ...], half_close: bool
) -> None:
    """The edge worker's internal Generate stream, as a buggy router could drive it: any start (token
    ids, sampling, resume, priority), cancels, empty frames, in any order, half-closed at once or after
    the first final frame (a stream the worker holds open with no turn running would only end at the
    deadline)."""
    test = "internal.Worker.Generate"
    async with grpc.aio.insecure_channel(fuzz_mesh.workers("edge")[0].address) as channel:
        call = channel.stream_stream(
            "/meshserve.internal.v1.Worker/Generate",
            request_serializer=worker_pb2.WorkerRequest.SerializeToString,
            response_deserializer=worker_pb2.WorkerResponse.FromString,
        )(metadata=metadata, timeout=WARM_TIMEOUT_S)
        replies: list[worker_pb2.WorkerResponse] = []
        try:
            for frame in frames:
                try:
                    await call.write(frame)
                except asyncio.InvalidStateError:  # the worker already answered (e.g. refused the start)
                    break
            half_close = half_close or not any(f.HasField("start") for f in frames)
            if half_close and not call.done():
                await call.done_writing()
            while (reply := await call.read()) is not grpc.aio.EOF:
                replies.append(reply)
                if not half_close and reply.HasField("final"):  # left open during the first turn
                    half_close = True
                    if not call.done():
                        await call.done_writing()
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # a long generation, or a stream left open
                record(test, exc.code().name)
                await _worker_idle(fuzz_mesh, test)
                return
            if local_write_race(exc):  # the worker ended the call while we wrote (see test_grpc_fuzz)
                record(test, "WRITE_RACE")
                return
            check_error(test, exc)
            return
        finally:
            call.cancel()
    record(test, "OK")
    expected = 0
    for reply in replies:  # per turn: frames numbered 0, 1, 2, ...; keepalives carry nothing
        if reply.queued:
            assert not reply.token_ids and not reply.text and not reply.HasField("final"), reply
            continue
        assert reply.sequence == expected, (reply.sequence, expected)
        expected = 0 if reply.HasField("final") else expected + 1
