"""The router core relaying a turn of n choices over a fake transport: chunks and Dones carry the choice
index, the turn ends after the n-th Done (``last``), a failure before anything was relayed is retried,
one after that ends the request (choices are not resumed one by one: none duplicated, none lost
silently), and n > 1 never touches the response cache."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from services.common import errors
from services.common.generation import GenerationEvent, GenerationRequest
from services.common.sampling import SamplingParams
from services.common.tokenizer import Tokenizer
from services.router.balancer.core import Chunk, Done, Session, TurnRequest
from services.router.balancer.tiers import TierName
from services.router.balancer.worker_stream import WorkerFailed
from services.store.response_cache import ResponseCache
from tests.unit.router.balancer.test_core_transport import FakeTransport, _router, _unavailable
from tests.worker_helpers import worker_final, worker_frame


@dataclass
class ChoiceStream:
    """Plays frames of (index, tokens) or (index, "final") or a failure, numbered as a worker numbers them."""

    replica: object
    script: list[tuple[int, list[int] | str] | WorkerFailed]
    starts: list[GenerationRequest] = field(default_factory=list)
    closed: bool = False
    _n: int = 0

    async def start(self, start: GenerationRequest) -> None:
        self.starts.append(start)

    async def cancel_turn(self) -> None:
        pass

    async def read(self) -> GenerationEvent:
        step = self.script.pop(0)
        if isinstance(step, WorkerFailed):
            raise step
        index, what = step
        n = self._n
        self._n += 1
        if what == "final":
            return worker_frame(n, [], "", final=worker_final(1, 3, 2, 3), index=index)
        assert isinstance(what, list)
        return worker_frame(n, what, "".join(f" t{t}" for t in what), index=index)

    def abort(self) -> None:
        self.closed = True

    async def close(self) -> None:
        self.closed = True


class ChoiceTransport(FakeTransport):
    def open(self, replica, timeout):  # type: ignore[no-untyped-def]
        stream = ChoiceStream(replica, self.scripts[replica.address].pop(0))  # type: ignore[arg-type]
        self.opened.append(stream)  # type: ignore[arg-type]
        return stream


def _request(n: int = 2) -> TurnRequest:
    sampling = SamplingParams(max_tokens=8, n=n)
    return TurnRequest([5, 6, 7], sampling, TierName.EDGE, True, False, "acme", "req-1")


async def test_choices_are_relayed_by_index_and_the_turn_ends_after_the_last_done(
    tokenizer: Tokenizer, cache: ResponseCache
) -> None:
    script = [(0, [1]), (1, [1]), (1, "final"), (0, [2]), (0, "final")]
    transport = ChoiceTransport({"edge-a": [script]})
    router = _router(tokenizer, cache, transport)
    events = [e async for e in router.run_turn(_request(), Session())]
    assert [(e.index, list(e.token_ids)) for e in events if isinstance(e, Chunk)] == [(0, [1]), (1, [1]), (0, [2])]
    dones = [e for e in events if isinstance(e, Done)]
    assert [(d.index, d.last, d.prompt_tokens, d.completion_tokens) for d in dones] == [
        (1, False, 3, 2),
        (0, True, 3, 2),
    ]
    assert transport.opened[0].starts[0].sampling.n == 2  # one turn of two choices on one worker


async def test_a_failure_before_anything_was_relayed_is_retried(tokenizer: Tokenizer, cache: ResponseCache) -> None:
    good = [(0, "final"), (1, "final")]
    transport = ChoiceTransport({"edge-a": [[_unavailable()]], "edge-b": [list(good)], "edge-c": [list(good)]})
    events = [e async for e in _router(tokenizer, cache, transport).run_turn(_request(), Session())]
    assert [e.index for e in events if isinstance(e, Done)] == [0, 1]


async def test_a_failure_after_a_choice_was_relayed_ends_the_request_without_resuming(
    tokenizer: Tokenizer, cache: ResponseCache
) -> None:
    transport = ChoiceTransport({"edge-a": [[(0, [1]), (1, "final"), _unavailable()]], "edge-b": [[]], "edge-c": [[]]})
    seen = []
    with pytest.raises(errors.Unavailable):
        async for event in _router(tokenizer, cache, transport).run_turn(_request(), Session()):
            seen.append(event)
    assert len(transport.opened) == 1  # not resumed elsewhere: no choice sent twice
    assert [type(e).__name__ for e in seen] == ["Chunk", "Done"]


async def test_n_choices_never_use_the_response_cache(tokenizer: Tokenizer, cache: ResponseCache) -> None:
    router = _router(tokenizer, cache, ChoiceTransport({}))
    assert router.keys.cache_key(_request(2), TierName.EDGE) is None
    assert router.keys.collapse_key(_request(2), TierName.EDGE, chat=False) is None
