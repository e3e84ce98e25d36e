"""Structured output on the batched edge engine with the real INT4 model: the output matches the
constraint, a constrained row decodes the same alone and in a batch, and a resumed stream continues exactly."""

from __future__ import annotations

import json
import re
from dataclasses import replace

from benchmarks.engine_stepper import EngineStepper
from services.common.constraints import check_constraint
from services.common.sampling import SamplingParams
from services.edge_worker.ort_engine import OrtEngine
from tests.integration.edge_worker.test_ort_engine import PROMPTS, chat, engine, generate, together

__all__ = ["engine"]  # the module-scoped engine fixture of test_ort_engine

DATE = SamplingParams(max_tokens=12, structured=check_constraint("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"))
PERSON = SamplingParams(
    max_tokens=40,
    structured=check_constraint(
        "json_schema",
        json.dumps(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
                "required": ["name", "age"],
                "additionalProperties": False,
            }
        ),
    ),
)


def test_the_output_matches_the_constraint_and_ends_with_eos(engine: OrtEngine) -> None:
    ids = chat(engine, "When did the first person land on the moon?")
    date = generate(engine, ids, DATE.max_tokens, DATE)  # the sequence ends at its EOS
    assert date[-1] in engine.info.eos_token_ids
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", engine.tokenizer.decode(date[:-1]))
    person = generate(engine, chat(engine, "Describe a person as JSON."), PERSON.max_tokens, PERSON)
    assert person[-1] in engine.info.eos_token_ids
    value = json.loads(engine.tokenizer.decode(person[:-1]))
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)


def test_a_constrained_row_decodes_the_same_alone_and_in_a_batch(engine: OrtEngine) -> None:
    prompts = [chat(engine, p) for p in PROMPTS]
    alone = generate(engine, prompts[1], 12, DATE)
    plain = [generate(engine, p, 12) for p in prompts]
    runs: list[tuple[list[int], int | SamplingParams]] = [(p, 12) for p in prompts]
    runs[1] = (prompts[1], DATE)
    runs.append((prompts[2], replace(PERSON, max_tokens=12)))  # a fifth: it waits for a slot
    got = together(engine, runs)
    assert got[1] == alone
    assert got[:1] + got[2:4] == plain[:1] + plain[2:]  # the mask never touches another row


def test_a_resumed_constrained_stream_continues_like_the_undisturbed_run(engine: OrtEngine) -> None:
    """The replayed tokens advance the grammar: the rest is the undisturbed run's, still valid."""
    ids = chat(engine, "Describe a person as JSON.")
    undisturbed = generate(engine, ids, 12, replace(PERSON, max_tokens=12))
    assert len(undisturbed) == 12
    resumed = EngineStepper(engine).generate(ids, replace(PERSON, max_tokens=7), replay=undisturbed[:5])
    assert resumed == undisturbed[5:]  # the driver advances the grammar over the replay, as the runtime does
