"""The structured-output constraint: cheap checks and limits, cache-key part, proto round trip."""

from __future__ import annotations

import json

import pytest

from services.common.constraints import (
    MAX_CONSTRAINT_BYTES,
    MAX_SCHEMA_DEPTH,
    Constraint,
    check_constraint,
    check_grammar,
    json_schema_constraint,
)
from services.common.errors import InvalidArgument
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.sampling import SamplingParams, resolve_sampling
from services.common.sampling_pb import from_pb, to_pb


def deep(levels: int) -> dict[str, object]:
    schema: dict[str, object] = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    ("kind", "text", "needle"),
    [
        ("yaml", "x", "kind 'yaml' is unknown"),
        ("regex", "", "the regex is empty"),
        ("grammar", "", "the grammar is empty"),
        ("regex", "a" * (MAX_CONSTRAINT_BYTES + 1), f"above the limit of {MAX_CONSTRAINT_BYTES}"),
        ("json_schema", "{not json", "not valid JSON"),
        ("json_schema", "[1, 2]", "must be a JSON object (got list)"),
        ("json_schema", json.dumps(deep(MAX_SCHEMA_DEPTH)), f"deeper than the limit of {MAX_SCHEMA_DEPTH} levels"),
    ],
)
def test_bad_constraints_are_invalid_argument_naming_the_field_and_limit(kind: str, text: str, needle: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        check_constraint(kind, text, field="response_format")
    assert needle in info.value.message
    assert info.value.message.startswith("response_format")


def test_a_schema_is_kept_compact_with_its_keys_in_their_order() -> None:
    """llguidance writes properties in the schema's order, so the order is part of the constraint."""
    a = check_constraint("json_schema", '{"type": "object",  "required": ["x"]}')
    assert a.text == '{"type":"object","required":["x"]}'
    assert check_constraint("json_schema", '{"type":"object","required":["x"]}') == a
    assert json_schema_constraint({"type": "object", "required": ["x"]}) == a
    swapped = check_constraint("json_schema", '{"required":["x"],"type":"object"}')
    assert swapped != a and swapped.digest != a.digest
    ordered = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    assert list(json.loads(json_schema_constraint(ordered).text)["properties"]) == ["name", "age"]
    assert check_constraint("json_object") == Constraint("json_object")
    assert check_constraint("json_schema", json.dumps(deep(MAX_SCHEMA_DEPTH // 2 - 1))).kind == "json_schema"


def test_the_constraint_is_part_of_the_cache_key_only_when_set() -> None:
    plain = SamplingParams(max_tokens=8)
    assert "structured" not in plain.canonical()  # keys made before structured output still match
    regex = SamplingParams(max_tokens=8, structured=check_constraint("regex", "[0-9]+"))
    other = SamplingParams(max_tokens=8, structured=check_constraint("regex", "[a-z]+"))
    assert regex.canonical() != plain.canonical()
    assert regex.canonical() != other.canonical()
    assert regex.canonical()["structured"] == {"kind": "regex", "digest": regex.structured.digest}  # type: ignore[union-attr]


def test_min_tokens_with_a_constraint_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="min_tokens cannot be combined with structured output"):
        resolve_sampling(min_tokens=2, structured=check_constraint("json_object"))


@pytest.mark.parametrize(
    "msg",
    [
        pb.StructuredOutput(json_schema='{"type":"object"}'),
        pb.StructuredOutput(json_object=True),
        pb.StructuredOutput(regex="[0-9]{3}"),
        pb.StructuredOutput(grammar='start: "yes" | "no"'),
    ],
)
def test_the_proto_round_trips(msg: pb.StructuredOutput) -> None:
    params = from_pb(pb.SamplingParams(max_tokens=4, structured=msg))
    assert params.structured is not None
    assert params.structured.kind == msg.WhichOneof("kind")
    assert to_pb(params).structured == msg
    assert from_pb(to_pb(params)) == params


def test_unset_or_false_json_object_means_no_constraint() -> None:
    assert from_pb(pb.SamplingParams()).structured is None
    assert from_pb(pb.SamplingParams(structured=pb.StructuredOutput(json_object=False))).structured is None
    assert not to_pb(SamplingParams(max_tokens=1)).HasField("structured")


def test_a_bad_proto_constraint_names_sampling_structured() -> None:
    with pytest.raises(InvalidArgument, match=r"^sampling\.structured: the json_schema is not valid JSON"):
        from_pb(pb.SamplingParams(structured=pb.StructuredOutput(json_schema="{")))


@pytest.mark.parametrize(
    ("kind", "text", "needle"),
    [
        ("json_schema", '{"type": "nope"}', "Invalid type: nope"),
        ("regex", "((", "unclosed group"),
        ("grammar", "start: missing", 'unknown name: "missing"'),
    ],
)
def test_check_grammar_refuses_what_llguidance_cannot_compile(kind: str, text: str, needle: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        check_grammar(check_constraint(kind, text))
    assert info.value.message.startswith(f"response_format (sampling.structured): the {kind} is not valid")
    assert needle in info.value.message


def test_check_grammar_accepts_each_kind() -> None:
    for kind, text in (
        ("json_object", ""),
        ("json_schema", '{"type": "integer"}'),
        ("regex", "a+"),
        ("grammar", 'start: "a"'),
    ):
        check_grammar(check_constraint(kind, text))
