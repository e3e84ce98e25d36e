"""Structured output on the cloud engine with the real model: the host sampler (eager steps) and the
device sampler (static steps) choose the same constrained tokens, alone and in a batch, and a resumed
stream's replayed tokens advance the grammar (the runtime compiles the constraint and advances it over
the replay before it adds the sequence: the stepper does the same)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace

import pytest

from benchmarks.engine_stepper import EngineStepper
from services.common.constraints import check_constraint
from services.common.errors import InvalidArgument
from services.common.sampling import SamplingParams
from services.gpu_worker.engine import CloudEngine
from tests.integration.gpu_worker.test_cloud_engine import encode, engine
from tests.integration.gpu_worker.test_static_decode import beside_others

pytestmark = pytest.mark.integration
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
CITY = SamplingParams(max_tokens=30, structured=check_constraint("json_schema", json.dumps(SCHEMA)))
PROMPT = "<|im_start|>user\nGive me a city as JSON.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def static() -> Iterator[CloudEngine]:
    e = engine(decode_graphs="on", max_batch=4)
    yield e
    e.close()


@pytest.fixture(scope="module")
def eager() -> Iterator[CloudEngine]:
    e = engine(decode_graphs="off")
    yield e
    e.close()


def run(e: CloudEngine, ids: list[int], sampling: SamplingParams, replay: list[int] | None = None) -> list[int]:
    """The tokens after ``replay`` (``max_tokens`` counts the turn's: the replayed ones too)."""
    replay = replay or []
    new = replace(sampling, max_tokens=sampling.max_tokens - len(replay))
    return EngineStepper(e).generate(ids, new, replay=replay)


def test_constrained_json_is_valid_and_the_same_on_eager_and_static_steps_alone_or_batched(
    eager: CloudEngine, static: CloudEngine
) -> None:
    ids = encode(eager, PROMPT)
    want = run(eager, ids, CITY)
    assert want[-1] in eager.info.eos_token_ids
    value = json.loads(eager.tokenizer.decode(want[:-1]))
    assert set(value) == {"city", "population"} and isinstance(value["population"], int)
    assert static.static is not None
    before = static.static.steps
    assert run(static, ids, CITY) == want
    assert static.static.steps - before >= 5  # the device sampler's mask ran
    assert beside_others(static, ids, CITY, max_tokens=60) == want


def test_a_resumed_constrained_stream_continues_like_the_undisturbed_run(static: CloudEngine) -> None:
    """Eager and static steps share the replay path (the scheduler records each replayed token)."""
    date = SamplingParams(max_tokens=12, structured=check_constraint("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"))
    ids = encode(
        static, "<|im_start|>user\nWhen did the first person land on the moon?<|im_end|>\n<|im_start|>assistant\n"
    )
    undisturbed = run(static, ids, date)
    assert run(static, ids, date, replay=undisturbed[:4]) == undisturbed[4:]


def test_a_schema_that_does_not_compile_fails_before_the_sequence_is_added(eager: CloudEngine) -> None:
    bad = SamplingParams(max_tokens=4, structured=check_constraint("json_schema", '{"type": "nope"}'))
    with pytest.raises(InvalidArgument, match="response_format"):
        EngineStepper(eager).add(encode(eager, "Hi"), bad)  # compiled as the runtime does, before add
    assert eager.next_step_in() is None
