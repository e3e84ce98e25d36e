"""The gateway's servicer over the router's API (a fake router here; the real one in process is in
tests/integration/gateway/test_embedded_router.py): what it passes the router (a domain request, the
pending admission, the deadline), what it does with the events (held until admission, numbered and
stamped once), and a router not yet started."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

import pytest

from services.common.errors import ResourceExhausted, Unavailable
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.sampling import SamplingParams
from services.gateway.admission import Gate
from services.gateway.auth import ApiKeyAuthenticator, hash_api_key, parse_api_keys
from services.gateway.config import GatewaySettings
from services.gateway.identity import Authenticator
from services.gateway.ratelimit import Reservation
from services.gateway.servicer import GatewayServicer
from services.router.balancer.tiers import TierName
from services.router.types import (
    ChatChannel,
    Chunk,
    Done,
    Event,
    Generation,
    ModelInfo,
    PendingAdmission,
    Route,
)

KEY = "key-acme"


class HeldLimiter:
    """Admits (or refuses, with ``refuse``) once ``release`` is set: a reservation still running."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.release = asyncio.Event()

    async def admit(self, tenant, policy, *, tokens, count_request, stream_ttl_s):  # type: ignore[no-untyped-def]
        await self.release.wait()
        if self.refuse:
            raise ResourceExhausted("rate limit: tenant acme is over its limit", 500)
        return Reservation(tenant, tokens, policy.tokens_per_minute, "")

    async def settle(self, *args: Any, **kwargs: Any) -> None:
        pass


class FakeRouter:
    """An in-process router that answers at once (before any admission is decided)."""

    overlaps_admission = True

    def __init__(self) -> None:
        self.requests: list[tuple[Generation, PendingAdmission | None, float | None]] = []
        self.sent = 0

    async def generate(
        self, request: Generation, admission: PendingAdmission | None = None, *, deadline: float | None = None
    ) -> AsyncGenerator[Event, None]:
        self.requests.append((request, admission, deadline))
        for i in range(3):
            self.sent += 1
            yield Chunk([i], f"t{i}")
        self.sent += 1
        yield Done(2, 4, 3, Route(TierName.EDGE, "edge-a", False, "hint"))

    async def complete(
        self, request: Generation, admission: PendingAdmission | None = None, *, deadline: float | None = None
    ) -> tuple[Chunk, Done]:
        raise NotImplementedError

    def chat(self, *, tenant: str = "", request_id: str = "", deadline: float | None = None) -> ChatChannel:
        raise NotImplementedError

    async def list_models(self, *, deadline: float | None = None) -> list[ModelInfo]:
        return [ModelInfo("m", (TierName.EDGE,), 2048)]


class FakeContext:
    """The part of a grpc ServicerContext the servicer uses (a unit test of the servicer alone)."""

    def __init__(self) -> None:
        self.trailing: tuple[tuple[str, str], ...] = ()
        self.callbacks: list[Any] = []

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {KEY}"),)

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.trailing = metadata

    def time_remaining(self) -> float | None:
        return None

    def add_done_callback(self, callback: Any) -> None:
        self.callbacks.append(callback)


def servicer(router: FakeRouter | None, limiter: HeldLimiter, **settings: Any) -> GatewayServicer:
    keys = f"acme:{hash_api_key(KEY)}"
    gate = Gate(
        Authenticator(ApiKeyAuthenticator(parse_api_keys(keys))),
        GatewaySettings().policy_book(),
        limiter,
        speculative_starts=1,
    )  # type: ignore[arg-type]
    config = GatewaySettings(api_keys=keys, default_deadline_s=30.0, access_log=False, **settings)
    return GatewayServicer(config, gate, router)  # type: ignore[arg-type]


async def until(condition: Callable[[], bool]) -> None:
    while not condition():  # noqa: ASYNC110  (a fake router: nothing to wait on but its counters)
        await asyncio.sleep(0.001)


def request() -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(max_tokens=3, temperature=0.5))


async def test_the_router_gets_a_domain_request_its_pending_admission_and_the_deadline() -> None:
    router, limiter = FakeRouter(), HeldLimiter()
    frames = servicer(router, limiter).Generate(request(), FakeContext())  # type: ignore[arg-type]
    first = asyncio.create_task(anext(frames))
    await asyncio.wait_for(until(lambda: router.sent > 0), 5)  # the router answers while the reservation runs
    generation, admission, deadline = router.requests[0]
    assert generation.prompt == "hello" and generation.tenant == "acme" and generation.request_id
    # The fields the request left unset go on as such: the router fills them with the model's defaults.
    unset = frozenset({"top_p", "top_k", "repetition_penalty", "stop"})
    assert generation.sampling == SamplingParams(max_tokens=3, temperature=0.5, defaulted=unset)
    assert admission is not None and not admission.decision.done() and admission.speculative
    assert deadline is not None and 29 < deadline - time.monotonic() <= 30
    await asyncio.sleep(0.01)
    assert not first.done()  # nothing reaches the caller before admission
    limiter.release.set()
    out = [await first] + [frame async for frame in frames]
    assert [f.sequence for f in out] == list(range(len(out)))  # numbered once, by the gateway
    assert {f.request_id for f in out} == {generation.request_id}
    assert "".join(f.text for f in out) == "t0t1t2" and out[-1].final.usage.completion_tokens == 3
    assert out[-1].final.route.worker_id == "edge-a"


async def test_a_refused_reservation_ends_the_stream_with_the_refusal_and_no_frame() -> None:
    router, limiter = FakeRouter(), HeldLimiter(refuse=True)
    frames = servicer(router, limiter).Generate(request(), FakeContext())  # type: ignore[arg-type]
    first = asyncio.create_task(anext(frames))
    await asyncio.wait_for(until(lambda: bool(router.requests)), 5)
    limiter.release.set()
    with pytest.raises(ResourceExhausted, match="rate limit"):
        await first


async def test_without_overlap_the_router_is_called_once_admitted() -> None:
    router, limiter = FakeRouter(), HeldLimiter()
    limiter.release.set()
    frames = servicer(router, limiter, overlap_admission=False).Generate(request(), FakeContext())  # type: ignore[arg-type]
    out = [frame async for frame in frames]
    (_, admission, _) = router.requests[0]
    assert admission is not None and admission.decision.done() and not admission.speculative
    assert len(out) >= 2 and out[-1].HasField("final")


async def test_calls_before_the_router_has_started_are_unavailable() -> None:
    limiter = HeldLimiter()
    limiter.release.set()
    gateway = servicer(None, limiter)
    with pytest.raises(Unavailable, match="still starting"):
        await anext(gateway.Generate(request(), FakeContext()))  # type: ignore[arg-type]
    with pytest.raises(Unavailable, match="still starting"):
        await gateway.ListModels(pb.ListModelsRequest(), FakeContext())  # type: ignore[arg-type]
    gateway.router = FakeRouter()  # type: ignore[assignment]
    reply = await gateway.ListModels(pb.ListModelsRequest(), FakeContext())  # type: ignore[arg-type]
    assert [m.id for m in reply.models] == ["m"] and list(reply.models[0].tiers) == [pb.TIER_EDGE]
