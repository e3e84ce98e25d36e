"""A background turn (a batch line) reaches the engine's sequence marked so: from the worker start frame
the router sends to the sequence the batched edge engine holds out of foreground prefills."""

from __future__ import annotations

from services.common.generation import GenerationRequest
from services.common.sampling import SamplingParams
from services.router.balancer.stream_transport import _start_pb
from services.worker.runner import Runner
from tests.unit.worker.fakes import TOKENIZER, FakeEngine

PROMPT = tuple(TOKENIZER.encode("hi"))


def test_the_start_frame_carries_the_background_mark() -> None:
    start = GenerationRequest((1, 2), SamplingParams(max_tokens=2), request_id="r", tenant="t")
    assert not _start_pb(start).background
    assert _start_pb(GenerationRequest((1, 2), SamplingParams(max_tokens=2), background=True)).background


async def test_the_runner_marks_the_engines_sequence() -> None:
    engine = FakeEngine("ab", loop=False)
    runner = Runner(engine, max_active=1, max_queue=0)
    try:
        for background in (True, False):
            request = GenerationRequest(PROMPT, SamplingParams(max_tokens=2), background=background)
            async for _ in runner.turn(request).events():
                pass
    finally:
        await runner.aclose()
    assert [s.background for s in engine.added] == [True, False]
