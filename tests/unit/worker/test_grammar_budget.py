"""Closing before the budget runs out (``GrammarCompiler.open(..., max_tokens=)``) on the served model's
tokenizer: whatever a writer picks among the allowed tokens, a constrained answer whose budget holds its
shortest valid ending ends with EOS inside the budget, valid (parsed, validated against its schema, a full
match of its regex), and says it was closed (``budget_closed``); without a budget the mask is the grammar's.

The "model" is a seeded writer that never ends on its own: it picks the allowed token that grows the text
most (long strings, deep nesting), or one at random, and EOS only when nothing else is allowed."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import numpy as np
import pytest
from tokenizers import Tokenizer

from services.common.constraints import Constraint, check_constraint
from services.common.model_paths import model_paths
from services.router.tools import Tool, ToolChoice, ToolChoiceMode, tool_constraint
from services.worker.grammar import GrammarCompiler, TokenConstraint

EOS = 2
VOCAB = 49152
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 3},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["name", "age", "tags", "address", "unit"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(model_paths().hf_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> Iterator[GrammarCompiler]:
    c = GrammarCompiler(tokenizer, VOCAB, [EOS])
    yield c
    c.close()


_LENGTHS: dict[int, np.ndarray] = {}


def _lengths(tokenizer: Tokenizer) -> np.ndarray:
    if id(tokenizer) not in _LENGTHS:
        _LENGTHS[id(tokenizer)] = np.array([len(tokenizer.id_to_token(i) or "") for i in range(VOCAB)])
    return _LENGTHS[id(tokenizer)]


def write(state: TokenConstraint, budget: int, rng: random.Random, tokenizer: Tokenizer) -> tuple[list[int], bool]:
    """The tokens a writer that never ends on its own produces within ``budget``; True if it ended with EOS."""
    lengths = _lengths(tokenizer)
    out: list[int] = []
    for _ in range(budget):
        allowed = np.flatnonzero(state.allowed())
        choices = allowed[allowed != EOS]
        if not choices.size:
            return out, True
        if rng.random() < 0.5:  # the longest piece of text: strings and nesting grow fastest
            pick = int(choices[np.argmax(lengths[choices])])
        else:
            pick = int(choices[rng.randrange(choices.size)])
        state.advance(pick)
        out.append(pick)
    return out, False


def constraints() -> list[tuple[str, Constraint, Any]]:
    weather = Tool(
        "get_weather", "", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    )
    add = Tool("add", "", {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}})
    out: list[tuple[str, Constraint, Any]] = [
        ("json_object", check_constraint("json_object"), {"type": "object"}),
        ("person", check_constraint("json_schema", json.dumps(PERSON)), PERSON),
    ]
    for mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.AUTO):
        tc = tool_constraint((weather, add), ToolChoice(mode))
        assert tc is not None
        kind = "json_schema" if tc.kind == "json_schema" else "grammar"
        schema = json.loads(tc.value) if kind == "json_schema" else None
        out.append((f"tools_{mode.value}", Constraint(kind, tc.value), schema))
    return out


@pytest.mark.parametrize(("name", "constraint", "schema"), constraints(), ids=lambda v: v if isinstance(v, str) else "")
def test_an_answer_whose_budget_holds_an_ending_always_ends_valid_within_it(
    compiler: GrammarCompiler, tokenizer: Tokenizer, name: str, constraint: Constraint, schema: Any
) -> None:
    # The shortest valid answer and its EOS, in tokens (what the budget must hold: an answer can still end
    # at length when the budget is smaller).
    shortest = {"json_object": 2, "person": 52, "tools_required": 15, "tools_auto": 2}[name]
    for seed in range(8):
        rng = random.Random(seed)
        budget = rng.randrange(shortest, 97)
        state = compiler.open(constraint, max_tokens=budget)
        tokens, ended = write(state, budget, rng, tokenizer)
        text = tokenizer.decode(tokens)
        if name == "tools_auto" and not text.startswith("<tool_call>"):
            assert state.accepting and not state.budget_closed  # free text: complete at any point, never forced
            continue
        assert ended, f"{name} seed {seed} budget {budget}: cut at length: {text!r}"
        assert len(tokens) < budget  # the EOS fits too
        if schema is not None:
            jsonschema.validate(json.loads(text), schema)
        elif name == "tools_auto" and text.startswith("<tool_call>"):
            for block in re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.S):
                assert json.loads(block)["name"] in ("get_weather", "add")
        assert state.budget_closed or state.accepting


def test_a_tool_call_begun_in_an_auto_turn_is_closed_as_a_call(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    (_, constraint, _) = constraints()[3]
    begun = tokenizer.encode(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "', add_special_tokens=False
    ).ids
    for seed in range(4):
        budget = len(begun) + 12 + 4 * seed
        state = compiler.open(constraint, begun, max_tokens=budget)
        tokens, ended = write(state, budget - len(begun), random.Random(seed), tokenizer)
        text = tokenizer.decode(begun + tokens)
        assert ended and state.budget_closed, text
        (block,) = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.S)
        assert json.loads(block)["name"] == "get_weather" and "city" in json.loads(block)["arguments"]


def test_near_the_end_content_stays_allowed_and_only_the_last_moment_forces_one_token(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    """Inside a string the model may write on until the tokens left are just the ending and its EOS; then
    only the ending's tokens are allowed, one at a time."""
    state = compiler.open(check_constraint("json_object"), max_tokens=24)
    begun = tokenizer.encode('{"story": "It was a dark', add_special_tokens=False).ids
    for token in begun:
        state.advance(token)
    lengths, sizes = _lengths(tokenizer), []
    while True:
        allowed = np.flatnonzero(state.allowed())
        sizes.append(allowed.size)
        if allowed.size == 1 and allowed[0] == EOS:
            break
        choices = allowed[allowed != EOS]
        state.advance(int(choices[np.argmax(lengths[choices])]))
    assert state.budget_closed and len(sizes) <= 24 - len(begun)
    assert sizes[-2:] == [1, 1]  # '"}' (one token), then EOS: forced
    assert min(sizes[:-2]) > 1000  # the string's content stayed allowed up to then


def test_without_a_budget_the_mask_is_the_grammars(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    c = check_constraint("json_schema", json.dumps(PERSON))
    plain, budgeted = compiler.open(c), compiler.open(c, max_tokens=500)
    for token in tokenizer.encode('{"address": {"city": "Paris and more', add_special_tokens=False).ids:
        assert np.array_equal(plain.allowed(), budgeted.allowed())
        plain.advance(token)
        budgeted.advance(token)
    assert not budgeted.budget_closed and not plain.budget_closed


def test_a_budget_shorter_than_any_valid_answer_is_left_to_end_at_length(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    state = compiler.open(check_constraint("json_schema", json.dumps(PERSON)), max_tokens=8)
    tokens, ended = write(state, 8, random.Random(1), tokenizer)
    assert not ended and len(tokens) == 8 and not state.budget_closed


def test_a_complete_answer_is_not_forced_and_a_regex_closes_to_a_full_match(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    done = compiler.open(check_constraint("regex", "(yes|no)( [0-9]+)?"), max_tokens=4)
    done.advance(tokenizer.token_to_id("yes"))
    assert done.accepting and not done.budget_closed and np.flatnonzero(done.allowed()).size > 1
    date = r"[0-9]{4}-[0-9]{2}-[0-9]{2}( at [0-9]{2}:[0-9]{2})?"
    for seed in range(6):
        state = compiler.open(check_constraint("regex", date), max_tokens=14)
        tokens, ended = write(state, 14, random.Random(seed), tokenizer)
        assert ended and re.fullmatch(date, tokenizer.decode(tokens)), tokenizer.decode(tokens)


def test_replayed_tokens_count_against_the_budget(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    c = check_constraint("json_object")
    prefix = tokenizer.encode('{"story": "Once upon a time there was a', add_special_tokens=False).ids
    state = compiler.open(c, prefix, max_tokens=len(prefix) + 3)  # a resumed stream with 3 tokens left
    tokens, ended = write(state, 3, random.Random(0), tokenizer)
    assert ended and state.budget_closed and len(tokens) + 1 <= 3
    assert json.loads(tokenizer.decode(prefix + tokens))["story"].startswith("Once")


def test_a_resumed_stream_closes_where_the_undisturbed_one_did(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    """When closing begins depends on the tokens alone (replayed ones count and are measured as generated
    ones), so a stream resumed on another worker continues exactly as it would have."""
    c = check_constraint("json_schema", json.dumps(PERSON))
    budget = 70
    state = compiler.open(c, max_tokens=budget)
    tokens, ended = write(state, budget, random.Random(3), tokenizer)
    assert ended and state.budget_closed
    replayed = compiler.open(c, max_tokens=budget)
    masks = []
    for token in tokens:  # the undisturbed run's masks, step by step
        masks.append(np.flatnonzero(replayed.allowed()).tolist())
        replayed.advance(token)
    for cut in (5, 23, 41):
        resumed = compiler.open(c, tokens[:cut], max_tokens=budget)
        for i, token in enumerate(tokens[cut:], cut):
            assert np.flatnonzero(resumed.allowed()).tolist() == masks[i], f"resumed at {cut}: step {i} differs"
            resumed.advance(token)
        assert np.flatnonzero(resumed.allowed()).tolist() == [EOS] and resumed.budget_closed
