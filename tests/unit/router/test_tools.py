"""Tools in domain types: limits (400s naming the field), the constraint each tool choice needs, the
cache-key part, and what is rendered into the prompt."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from services.common.constraints import check_constraint
from services.common.errors import InvalidArgument
from services.common.model_paths import model_paths
from services.common.sampling import SamplingParams
from services.common.tokenizer import Tokenizer
from services.router import tools as t
from services.router.frontend.tool_parser import ToolCallParser
from services.router.tools import Tool, ToolCall, ToolChoice, ToolChoiceMode

WEATHER = Tool(
    "get_weather",
    "The weather in a city",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
ADD = Tool("add", "", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}})
AUTO = ToolChoice(ToolChoiceMode.AUTO)


def named(name: str) -> ToolChoice:
    return ToolChoice(ToolChoiceMode.FUNCTION, name)


@pytest.mark.parametrize(
    ("tools", "choice", "message"),
    [
        ([Tool(f"f{i}") for i in range(t.MAX_TOOLS + 1)], AUTO, "tools has 129 entries; send at most 128"),
        ([Tool("bad name")], AUTO, r"tools\[0\].function.name 'bad name' must be 1 to 64"),
        ([Tool("x" * 65)], AUTO, "must be 1 to 64"),
        ([Tool("f"), Tool("f")], AUTO, "appears twice"),
        ([Tool("f", "d" * (t.MAX_TOOL_DESCRIPTION_CHARS + 1))], AUTO, r"tools\[0\].function.description is 8193"),
        (
            [Tool(f"f{i}", "d" * t.MAX_TOOL_DESCRIPTION_CHARS) for i in range(17)],
            AUTO,
            "above the limit of 131072",
        ),
        ([], ToolChoice(ToolChoiceMode.REQUIRED), "tool_choice is 'required' but the request has no tools"),
        ([WEATHER], named("add"), "tool_choice names function 'add', which is not among the request's tools"),
    ],
)
def test_tools_over_a_limit_are_refused_naming_the_field(tools: list[Tool], choice: ToolChoice, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        t.check_tools(tools, choice)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "is not valid JSON"),
        ("[]", "must be a JSON Schema object"),
        ('{"type": "string"}', "must describe an object"),
        ("x" * (t.MAX_TOOL_PARAMETERS_CHARS + 1), "above the limit of 16384"),
        ('{"type": "object", "properties": ' + '{"a": ' * 20 + "{}" + "}" * 20 + "}", "nested more than 16"),
    ],
)
def test_parameters_schemas_are_checked(text: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=rf"tools\[0\].function.parameters .*{message}|{message}"):
        t.parse_parameters(text, "tools[0].function.parameters")


def test_a_call_sent_back_is_checked() -> None:
    t.check_tool_call(ToolCall("call_1", "add", "{}"), "messages[1].tool_calls[0]")
    with pytest.raises(InvalidArgument, match=r"messages\[1\].tool_calls\[0\].id is longer than 256"):
        t.check_tool_call(ToolCall("c" * 257, "add", "{}"), "messages[1].tool_calls[0]")
    with pytest.raises(InvalidArgument, match="arguments is 32769 characters"):
        t.check_tool_call(ToolCall("c", "add", "x" * 32769), "messages[1].tool_calls[0]")


def test_the_choice_defaults_to_auto_with_tools_and_none_without() -> None:
    assert t.effective_choice([WEATHER], None).mode is ToolChoiceMode.AUTO
    assert t.effective_choice([], None) == t.NO_TOOLS
    assert t.effective_choice([], AUTO) == t.NO_TOOLS
    assert not t.calls_possible([WEATHER], ToolChoice(ToolChoiceMode.NONE))


def test_prompt_tools_none_renders_nothing_and_a_named_choice_only_its_function() -> None:
    assert t.prompt_tools([WEATHER, ADD], ToolChoice(ToolChoiceMode.NONE)) is None
    rendered = t.prompt_tools([WEATHER, ADD], named("add"))
    assert rendered == [{"type": "function", "function": {"name": "add", "parameters": dict(ADD.parameters)}}]
    assert [x["function"]["name"] for x in t.prompt_tools([WEATHER, ADD], AUTO) or []] == ["get_weather", "add"]
    assert Tool("f").openai()["function"]["parameters"] == {"type": "object", "properties": {}}


def test_tools_and_choice_are_in_the_cache_key_and_absent_without_tools() -> None:
    assert t.tools_key([], t.NO_TOOLS) == ""
    keys = {
        t.tools_key([WEATHER], AUTO),
        t.tools_key([WEATHER], ToolChoice(ToolChoiceMode.REQUIRED)),
        t.tools_key([WEATHER], ToolChoice(ToolChoiceMode.REQUIRED, parallel=False)),
        t.tools_key([WEATHER], named("get_weather")),
        t.tools_key([WEATHER, ADD], AUTO),
        t.tools_key([WEATHER], ToolChoice(ToolChoiceMode.NONE)),
    }
    assert len(keys) == 6
    assert t.tools_key([WEATHER], AUTO) == t.tools_key([WEATHER], AUTO)


def _schema(choice: ToolChoice, tools: list[Tool] | None = None) -> Any:
    constraint = t.tool_constraint(tools or [WEATHER, ADD], choice)
    assert constraint is not None and constraint.kind == "json_schema"
    return json.loads(constraint.value)


def test_a_named_choice_is_the_schema_of_one_call_with_its_name_first() -> None:
    schema = _schema(named("add"))
    assert list(schema["properties"]) == ["name", "arguments"]  # the name streams first
    assert schema["properties"]["name"] == {"const": "add"}
    assert schema["properties"]["arguments"] == ADD.parameters
    assert schema["required"] == ["name", "arguments"] and schema["additionalProperties"] is False


def test_required_is_any_call_or_an_array_of_calls_with_parallel_calls() -> None:
    parallel = _schema(ToolChoice(ToolChoiceMode.REQUIRED))
    assert parallel["type"] == "array" and parallel["minItems"] == 1
    assert [s["properties"]["name"]["const"] for s in parallel["items"]["anyOf"]] == ["get_weather", "add"]
    single = _schema(ToolChoice(ToolChoiceMode.REQUIRED, parallel=False))
    assert [s["properties"]["name"]["const"] for s in single["anyOf"]] == ["get_weather", "add"]
    one_tool = _schema(ToolChoice(ToolChoiceMode.REQUIRED, parallel=False), [WEATHER])
    assert one_tool["properties"]["name"] == {"const": "get_weather"}


def test_auto_is_a_grammar_of_text_or_call_blocks_and_none_is_unconstrained() -> None:
    constraint = t.tool_constraint([WEATHER], AUTO)
    assert constraint is not None and constraint.kind == "grammar"
    assert '"<tool_call>\\n" call_json "\\n</tool_call>"' in constraint.value
    assert "%json" in constraint.value
    single = t.tool_constraint([WEATHER], ToolChoice(parallel=False))
    assert single is not None and "calls: call\n" in single.value
    assert t.tool_constraint([WEATHER], ToolChoice(ToolChoiceMode.NONE)) is None
    assert t.tool_constraint([], AUTO) is None


@pytest.mark.parametrize(
    "choice",
    [AUTO, ToolChoice(parallel=False), ToolChoice(ToolChoiceMode.REQUIRED), named("get_weather")],
    ids=["auto", "auto-single", "required", "named"],
)
def test_every_constraint_compiles_with_llguidance(choice: ToolChoice) -> None:
    """The grammar library the structured-output machinery uses accepts each constraint as is."""
    llguidance = pytest.importorskip("llguidance")
    constraint = t.tool_constraint([WEATHER, ADD], choice)
    assert constraint is not None
    matcher = llguidance.LLMatcher
    grammar = (
        matcher.grammar_from_lark(constraint.value)
        if constraint.kind == "grammar"
        else matcher.grammar_from_json_schema(constraint.value)
    )
    assert matcher.validate_grammar(grammar) == ""


CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
OUTPUTS = {
    "auto": (AUTO, f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL}\n</tool_call>", 2),
    "auto-text": (AUTO, "It is sunny in Paris.", 0),
    "required": (ToolChoice(ToolChoiceMode.REQUIRED), f"[{CALL}, {CALL}]", 2),
    "required-single": (ToolChoice(ToolChoiceMode.REQUIRED, parallel=False), CALL, 1),
    "named": (named("get_weather"), CALL, 1),
}


@pytest.fixture(scope="module")
def matcher_for() -> Any:
    """A matcher of a constraint over the model's own vocabulary, as the structured-output step builds it."""
    llguidance = pytest.importorskip("llguidance")
    vocabulary = llguidance.LLTokenizer(str(model_paths().hf_dir / "tokenizer.json"))

    def make(constraint: t.ToolConstraint) -> Any:
        m = llguidance.LLMatcher
        grammar = (
            m.grammar_from_lark(constraint.value)
            if constraint.kind == "grammar"
            else m.grammar_from_json_schema(constraint.value)
        )
        return m(vocabulary, grammar)

    return make


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(model_paths().hf_dir)


@pytest.mark.parametrize("case", list(OUTPUTS))
def test_output_the_constraint_allows_is_what_the_parser_reads_as_calls(
    matcher_for: Any, tok: Tokenizer, case: str
) -> None:
    """The constraint and the parser agree: text in the prompt's format passes the constraint token by
    token, and the parser reads exactly the expected calls from it, with schema-valid arguments."""

    choice, text, expected = OUTPUTS[case]
    constraint = t.tool_constraint([WEATHER, ADD], choice)
    assert constraint is not None
    matcher = matcher_for(constraint)
    for token in tok.encode(text, add_special_tokens=False):
        assert matcher.consume_token(token), (case, matcher.get_error())
    assert matcher.is_accepting()
    names = [choice.function_name] if choice.mode is ToolChoiceMode.FUNCTION else ["get_weather", "add"]
    parser = ToolCallParser(names, parallel=choice.parallel, bare_json=choice.mode is not ToolChoiceMode.AUTO)
    content, deltas = parser.feed(text)
    rest, more = parser.finish()
    assert parser.calls == expected
    assert (content + rest == "") == bool(expected)
    for delta in [*deltas, *more]:
        assert not delta.id or delta.name == "get_weather"
    arguments = "".join(d.arguments for d in [*deltas, *more] if d.index == 0)
    if expected:
        assert json.loads(arguments) == {"city": "Paris"}


def test_the_constraint_holds_calls_to_the_schema_and_the_prompts_layout(matcher_for: Any, tok: Tokenizer) -> None:
    for choice, bad in (
        (named("get_weather"), '{"name": "add"'),  # another function than the one named
        (named("get_weather"), '{"name": "get_weather", "arguments": {"city": 3'),  # city must be a string
        (ToolChoice(ToolChoiceMode.REQUIRED), "Sure"),  # text where a call is required
        (AUTO, '<tool_call>\n{"name": "nope"'),  # a function that is not a tool
        (named("get_weather"), '{\n  "name"'),  # indented, not the prompt's layout
    ):
        constraint = t.tool_constraint([WEATHER, ADD], choice)
        assert constraint is not None
        matcher = matcher_for(constraint)
        ok = all(matcher.consume_token(token) for token in tok.encode(bad, add_special_tokens=False))
        assert not ok, bad


def test_constrained_sets_the_tool_constraint_and_refuses_a_second_one() -> None:
    tools = [WEATHER]
    plain = SamplingParams(max_tokens=16)
    required = ToolChoice(ToolChoiceMode.REQUIRED)
    got = t.constrained(plain, tools, required)
    expected = t.tool_constraint(tools, required)
    assert got.structured is not None and expected is not None
    assert (got.structured.kind, got.structured.text) == ("json_schema", expected.value)
    auto = t.constrained(plain, tools, ToolChoice(ToolChoiceMode.AUTO)).structured
    assert auto is not None and auto.kind == "grammar"
    assert t.constrained(plain, tools, ToolChoice(ToolChoiceMode.NONE)) is plain
    with pytest.raises(InvalidArgument, match="response_format"):
        t.constrained(replace(plain, structured=check_constraint("json_object")), tools, required)
