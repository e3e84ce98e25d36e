"""OpenAI request JSON -> proto (services/gateway/http/openai_request.py); the n-choices test also checks
the answer's usage (openai_reply.py)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.errors import InvalidArgument
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.gateway.http import openai_reply, openai_request


def test_chat_request_maps_messages_sampling_and_stream_options() -> None:
    parsed, request = openai_request.chat_request(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]},
            ],
            "max_completion_tokens": 9,
            "temperature": 0,
            "top_p": 0.5,
            "seed": 7,
            "stop": "\n",
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert parsed == openai_request.Parsed(model="m", stream=True, include_usage=True)
    turn = request.turn
    assert [(m.role, m.content) for m in turn.messages] == [("system", "Be brief."), ("user", "Hello")]
    assert (turn.model, turn.sampling.max_tokens, turn.sampling.temperature) == ("m", 9, 0.0)
    assert turn.sampling.top_p == 0.5 and turn.sampling.seed == 7 and list(turn.sampling.stop) == ["\n"]


def test_omitted_sampling_fields_stay_unset_for_the_models_defaults() -> None:
    _, request = openai_request.completion_request({"prompt": ["one prompt"]})
    assert request.prompt == "one prompt"
    for name in ("temperature", "top_p", "top_k", "repetition_penalty", "seed"):
        assert not request.sampling.HasField(name), name  # the served model's default fills it (the router)
    assert request.sampling.max_tokens == 0 and not request.sampling.stop
    _, sent = openai_request.completion_request({"prompt": "x", "temperature": 0, "top_p": 1, "top_k": -1})
    assert sent.sampling.HasField("temperature") and sent.sampling.temperature == 0.0  # explicit 0 wins
    assert sent.sampling.HasField("top_p") and sent.sampling.HasField("top_k") and sent.sampling.top_k == 0


@pytest.mark.parametrize(
    "body",
    [
        {"messages": []},
        {"messages": "hi"},
        {"messages": [{"content": "no role"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        {"messages": [{"role": "user", "content": "x"}], "n": 17},  # n is served, 1 to 16
        {"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"},
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
        {"messages": [{"role": "user", "content": "x"}], "stop": [1]},
        {"messages": [{"role": "user", "content": "x"}], "stream": "yes"},
        {"messages": [{"role": "user", "content": "x"}], "model": 3},
    ],
)
def test_bad_chat_requests_are_invalid_argument(body: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument):
        openai_request.chat_request(body)


def test_completion_needs_one_string_prompt() -> None:
    with pytest.raises(InvalidArgument):
        openai_request.completion_request({"prompt": ["a", "b"]})


CHAT = {"messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"seed": 2**64}, "'seed' must be between"),  # protobuf's range error was an HTTP 500
        ({"max_tokens": 2**32}, "'max_tokens' must be between"),  # the same for uint32
        ({"max_tokens": 0}, "'max_tokens' must be between 1"),  # 0 meant the 256-token default
        ({"max_completion_tokens": 0}, "'max_completion_tokens' must be between 1"),
        ({"n": 0}, "'n' must be between 1 and 16"),
        ({"n": 17}, "'n' must be between 1 and 16"),
        ({"n": 2.5}, "'n' must be an integer"),
        ({"stream_options": "yes"}, "'stream_options' must be an object"),
        ({"frequency_penalty": "high"}, "'frequency_penalty' must be a number"),
        ({"presence_penalty": True}, "'presence_penalty' must be a number"),
        ({"repetition_penalty": [1]}, "'repetition_penalty' must be a number"),
        ({"logit_bias": [1]}, "'logit_bias' must be an object"),
        ({"logit_bias": {"abc": 1}}, "'logit_bias' key 'abc' is not a token id"),
        ({"logit_bias": {"-1": 1}}, "'logit_bias' key '-1' is not a token id"),
        ({"logit_bias": {"5": "x"}}, "'logit_bias' value for token 5 must be a number"),
        ({"min_tokens": -1}, "'min_tokens' must be between 0"),
        ({"min_tokens": 1.5}, "'min_tokens' must be an integer"),
        ({"response_format": {"type": "xml"}}, "'response_format' type 'xml' is not supported"),
        ({"response_format": "json"}, "'response_format' must be an object"),
        ({"response_format": {"type": "json_schema"}}, "'response_format.json_schema' must be an object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema' is missing"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "must be a JSON object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "y"}}}, "strict"),
        ({"functions": [{"name": "f"}]}, "the legacy 'functions' are not supported"),
        ({"tool_choice": "maybe"}, "'tool_choice' must be 'auto', 'none', 'required' or"),
        ({"tools": [{"type": "code_interpreter"}]}, "only function tools are supported"),
        ({"tools": {"type": "function"}}, "'tools' must be a list"),
        ({"parallel_tool_calls": "yes"}, "'parallel_tool_calls' must be true or false"),
        ({"modalities": ["text", "audio"]}, "only text output"),
        ({"audio": {"voice": "alloy"}}, "audio output is not supported"),
        ({"logprobs": 1}, "'logprobs' must be true or false"),
        ({"logprobs": True, "top_logprobs": 21}, "'top_logprobs' must be between 0 and 20"),
        ({"top_logprobs": 3}, "'top_logprobs' needs 'logprobs' set to true"),
    ],
)
def test_fields_that_would_change_the_answer_or_do_not_fit_are_refused(extra: dict[str, object], why: str) -> None:
    with pytest.raises(InvalidArgument, match=why):
        openai_request.chat_request({**CHAT, **extra})


@pytest.mark.parametrize(
    "extra",
    [
        {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "n": 1, "logprobs": False},
        {"response_format": {"type": "text"}, "tool_choice": "none", "tools": [], "modalities": ["text"]},
        {"user": "alice", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "some_new_field": 1},
        {"top_logprobs": 0, "parallel_tool_calls": False, "function_call": "auto", "functions": []},
    ],
)
def test_neutral_values_and_bookkeeping_fields_are_accepted(extra: dict[str, object]) -> None:
    parsed, _ = openai_request.chat_request({**CHAT, **extra})
    assert parsed.stream is False


def test_response_format_becomes_the_structured_constraint() -> None:
    _, chat = openai_request.chat_request({**CHAT, "response_format": {"type": "json_object"}})
    assert chat.turn.sampling.structured.json_object
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    strict = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    _, completion = openai_request.completion_request({"prompt": "p", "response_format": strict})
    assert json.loads(completion.sampling.structured.json_schema) == schema
    _, plain = openai_request.chat_request({**CHAT, "response_format": {"type": "text"}})
    assert not plain.turn.sampling.HasField("structured")


def test_completion_defaults_that_change_nothing_are_accepted() -> None:
    _, request = openai_request.completion_request(
        {"prompt": "p", "best_of": 1, "suffix": "", "echo": False, "logprobs": None}
    )
    assert request.prompt == "p"
    with pytest.raises(InvalidArgument, match="best_of"):
        openai_request.completion_request({"prompt": "p", "best_of": 2})
    with pytest.raises(InvalidArgument, match="suffix"):
        openai_request.completion_request({"prompt": "p", "suffix": "end"})


def test_penalties_logit_bias_and_min_tokens_map_to_the_sampling_fields() -> None:
    body: dict[str, Any] = {"frequency_penalty": 0.5, "presence_penalty": -1, "repetition_penalty": 1.3}
    body |= {"min_tokens": 4, "logit_bias": {"50": -100, "7": 2.5}}
    _, chat = openai_request.chat_request({**CHAT, **body})
    _, completion = openai_request.completion_request({"prompt": "p", **body})
    for s in (chat.turn.sampling, completion.sampling):
        assert s.frequency_penalty == 0.5 and s.presence_penalty == -1 and s.min_tokens == 4
        assert s.HasField("repetition_penalty") and math.isclose(s.repetition_penalty, 1.3, rel_tol=1e-6)
        assert dict(s.logit_bias) == {50: -100.0, 7: 2.5}
    _, plain = openai_request.chat_request(CHAT)  # absent: the mesh's default (the chat default for a chat)
    assert not plain.turn.sampling.HasField("repetition_penalty") and not plain.turn.sampling.logit_bias


def test_seed_is_openais_int64_and_top_k_is_honoured() -> None:
    _, request = openai_request.chat_request({**CHAT, "seed": -1, "top_k": 5})
    assert request.turn.sampling.seed == 2**64 - 1 and request.turn.sampling.top_k == 5
    _, request = openai_request.chat_request({**CHAT, "seed": 2**64 - 1, "top_k": -1})  # vLLM's "top_k off"
    assert request.turn.sampling.seed == 2**64 - 1 and request.turn.sampling.top_k == 0
    with pytest.raises(InvalidArgument, match="'seed' must be between"):
        openai_request.chat_request({**CHAT, "seed": -(2**63) - 1})


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    _, request = openai_request.chat_request({**CHAT, "max_completion_tokens": 4, "max_tokens": 2})
    assert request.turn.sampling.max_tokens == 4


def test_error_messages_do_not_echo_huge_values() -> None:
    with pytest.raises(InvalidArgument) as info:
        openai_request.chat_request({**CHAT, "temperature": "x" * 100_000})
    assert len(info.value.message) < 120


def test_an_unsupported_content_part_is_named() -> None:
    refusal = {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}
    with pytest.raises(InvalidArgument, match="part of type 'refusal' is not supported"):
        openai_request.chat_request({"messages": [{"role": "user", "content": "x"}, refusal]})


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        ('{"messages": [{"role": "user", "content": "\\ud800"}]}', "'messages[0].content'"),
        ('{"messages": [{"role": "user", "content": "\\ude00\\ud83d"}]}', "'messages[0].content'"),
        ('{"prompt": ["ok", "x\\udfff"]}', "'prompt[1]'"),
        ('{"a": {"b\\udc00": 1}}', "a key in 'a'"),
        ('{"\\udc00": 1}', "a key of the request body"),
        ('"\\ud800"', "the request body"),
        ('{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}', None),  # a valid pair
        ('{"n": 1, "x": [null, true, 2.5]}', None),
    ],
)
def test_invalid_unicode_field_names_the_first_bad_string(raw: str, where: str | None) -> None:
    assert openai_request.invalid_unicode_field(json.loads(raw)) == where


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_tools_tool_choice_and_tool_messages_become_the_turns_fields() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"P"}'}}
    body = {
        "messages": [
            {"role": "user", "content": "Weather?", "name": "ann"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "21 C"}]},
        ],
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
    }
    parsed, request = openai_request.chat_request(body)
    turn = request.turn
    assert parsed.tools
    (tool,) = turn.tools
    assert (tool.name, tool.description) == ("get_weather", "The weather")
    assert json.loads(tool.parameters_json) == WEATHER_TOOL["function"]["parameters"]  # type: ignore[index]
    assert turn.tool_choice.mode == pb.TOOL_CHOICE_FUNCTION and turn.tool_choice.function_name == "get_weather"
    assert turn.tool_choice.parallel_tool_calls is False
    assert turn.messages[0].name == "ann"
    assert list(turn.messages[1].tool_calls) == [pb.ToolCall(id="call_1", name="get_weather", arguments='{"city":"P"}')]
    assert (turn.messages[2].role, turn.messages[2].tool_call_id, turn.messages[2].content) == (
        "tool",
        "call_1",
        "21 C",
    )
    none, _ = openai_request.chat_request({**CHAT, "tools": [WEATHER_TOOL], "tool_choice": "none"})
    assert not none.tools
    _, plain = openai_request.chat_request(CHAT)
    assert not plain.turn.HasField("tool_choice") and not plain.turn.tools


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=5),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=8,
)


_function = st.fixed_dictionaries(
    {},
    optional={"name": st.sampled_from(["f", "g", "bad name", ""]) | _json, "parameters": _json, "description": _json},
)


_tool = st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "x"]) | _json}, optional={"function": _function | _json}
)


@given(
    tools=st.lists(_tool | _json, max_size=3) | _json,
    choice=st.sampled_from(["auto", "none", "required", {"type": "function", "function": {"name": "f"}}]) | _json,
    calls=st.lists(st.fixed_dictionaries({"id": _json, "function": _function | _json}) | _json, max_size=2) | _json,
    extra=st.fixed_dictionaries({}, optional={"name": _json, "tool_call_id": _json}),
)
@settings(max_examples=300, deadline=None)
def test_any_tools_json_is_a_turn_or_a_400_never_a_crash(tools: Any, choice: Any, calls: Any, extra: Any) -> None:
    from services.router.frontend import convert

    body = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": calls, **extra},
        ],
        "tools": tools,
        "tool_choice": choice,
    }
    try:
        _, request = openai_request.chat_request(body)
        convert.chat_turn(request.turn)
    except InvalidArgument as exc:
        assert exc.message


def test_n_choices_reach_the_proto_and_usage_counts_the_prompt_once() -> None:
    parsed, request = openai_request.chat_request({**CHAT, "n": 3})
    assert parsed.n == 3 and request.turn.sampling.n == 3
    parsed, generate = openai_request.completion_request({"prompt": "p"})
    assert parsed.n == 1 and not generate.sampling.HasField("n")
    finals = [pb.Final(usage=pb.Usage(prompt_tokens=5, completion_tokens=c)) for c in (2, 3, 4)]
    body = openai_reply.chat_completion("rid", "m", ["a", "b", "c"], finals)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == ["a", "b", "c"]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}
    assert openai_reply.completions("rid", "m", ["x", "y", "z"], finals)["usage"]["completion_tokens"] == 9
    assert openai_reply.chat_chunk("rid", "m", {"content": "a"}, None, 1, index=2)["choices"][0]["index"] == 2
    assert openai_reply.usage_chunk("text_completion", "rid", "m", finals, 1)["usage"]["prompt_tokens"] == 5


def test_logprobs_fields_become_sampling_fields() -> None:
    _, chat = openai_request.chat_request({**CHAT, "logprobs": True, "top_logprobs": 20})
    assert chat.turn.sampling.logprobs and chat.turn.sampling.top_logprobs == 20
    _, plain = openai_request.chat_request({**CHAT, "logprobs": False, "top_logprobs": 0})
    assert not plain.turn.sampling.logprobs
    _, completion = openai_request.completion_request({"prompt": "p", "logprobs": 0})
    assert completion.sampling.logprobs and completion.sampling.top_logprobs == 0
    _, completion = openai_request.completion_request({"prompt": "p", "logprobs": 5})
    assert completion.sampling.top_logprobs == 5
    for body, needle in (
        ({"prompt": "p", "logprobs": 6}, "'logprobs' must be between 0 and 5"),
        ({"prompt": "p", "logprobs": True}, "'logprobs' must be an integer"),
        ({"prompt": "p", "top_logprobs": 2}, "'top_logprobs' is a chat completions field"),
    ):
        with pytest.raises(InvalidArgument, match=needle):
            openai_request.completion_request(body)
