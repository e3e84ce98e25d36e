"""The incremental tool-call parser: scripted model output, fed in pieces of every size, must give the
same content and calls as fed whole; the deltas must be OpenAI's (first: index, id, name; then
argument fragments)."""

from __future__ import annotations

import json
from itertools import count

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.router.frontend.tool_parser import ToolCallParser, new_call_id
from services.router.tools import ToolCallDelta

NAMES = ("get_weather", "add")
WEATHER = '{"name": "get_weather", "arguments": {"city": "Pa\\"ris", "days": [1, 2], "opts": {"u": "C"}}}'
ADD = '{"name": "add", "arguments": {"a": 1, "b": 2}}'


def run(text: str, step: int = 0, **kw: object) -> tuple[str, list[ToolCallDelta], int]:
    """The content, the deltas and the call count of ``text`` fed ``step`` characters at a time (0: whole)."""
    ids = count()
    parser = ToolCallParser(NAMES, new_id=lambda: f"call_{next(ids)}", **kw)  # type: ignore[arg-type]
    content: list[str] = []
    deltas: list[ToolCallDelta] = []
    pieces = [text] if not step else [text[i : i + step] for i in range(0, len(text), step)]
    for piece in pieces:
        c, d = parser.feed(piece)
        content.append(c)
        deltas.extend(d)
    c, d = parser.finish()
    content.append(c)
    deltas.extend(d)
    return "".join(content), deltas, parser.calls


def calls(deltas: list[ToolCallDelta]) -> list[tuple[str, str, str]]:
    """Deltas accumulated as a client does: (id, name, arguments) per index."""
    out: dict[int, list[str]] = {}
    for d in deltas:
        call = out.setdefault(d.index, ["", "", ""])
        if d.id:
            assert not call[0], "a call's id comes once, in its first delta"
            call[0], call[1] = d.id, d.name
        else:
            assert call[0], "a call's first delta has its id and name"
            assert not d.name
        call[2] += d.arguments
    return [(i, n, a) for i, n, a in (out[k] for k in sorted(out))]


def test_content_then_two_calls_stream_as_openai_deltas() -> None:
    text = f"Let me check. <tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{ADD}\n</tool_call>\n"
    content, deltas, n = run(text, step=3)
    assert content == "Let me check. "
    assert n == 2
    assert deltas[0] == ToolCallDelta(0, "call_0", "get_weather", "")
    assert all(not d.id and d.arguments for d in deltas[1:] if d.index == 0)
    assert calls(deltas) == [
        ("call_0", "get_weather", json.dumps(json.loads(WEATHER)["arguments"])),
        ("call_1", "add", '{"a": 1, "b": 2}'),
    ]
    assert json.loads(calls(deltas)[0][2]) == {"city": 'Pa"ris', "days": [1, 2], "opts": {"u": "C"}}


@given(st.integers(min_value=1, max_value=40))
@settings(max_examples=40, deadline=None)
def test_any_split_of_the_output_gives_the_same_calls(step: int) -> None:
    text = f"Sure<tool_call>\n{WEATHER}\n</tool_call><tool_call>{ADD}</tool_call>"
    whole, deltas_whole, _ = run(text)
    split, deltas_split, _ = run(text, step=step)
    assert split == whole == "Sure"
    assert calls(deltas_split) == calls(deltas_whole)


def test_plain_text_passes_through_and_a_partial_tag_is_held_until_it_is_not_one() -> None:
    parser = ToolCallParser(NAMES)
    assert parser.feed("a < b and <tool_") == ("a < b and ", [])
    assert parser.feed("box") == ("<tool_box", [])
    assert parser.finish() == ("", [])
    assert run("  Hello there", step=1)[0] == "  Hello there"


@pytest.mark.parametrize(
    "block",
    [
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',  # not a tool of the turn
        "<tool_call>not json</tool_call>",
    ],
)
def test_a_block_that_is_no_call_of_the_turn_is_content(block: str) -> None:
    content, deltas, n = run(block + " after", step=4)
    assert (content, deltas, n) == (block + " after", [], 0)


def test_other_key_orders_are_parsed_whole_at_the_close() -> None:
    content, deltas, n = run('<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call>', step=5)
    assert (content, n) == ("", 1)
    assert deltas == [ToolCallDelta(0, "call_0", "add", '{"a": 1}')]


def test_parameters_is_read_as_arguments_and_an_unclosed_block_is_closed_by_the_end() -> None:
    _, deltas, n = run('<tool_call>\n{"name": "add", "parameters": {"a": 1}}', step=2)
    assert n == 1 and calls(deltas) == [("call_0", "add", '{"a": 1}')]


def test_a_call_cut_short_counts_and_keeps_what_was_sent() -> None:
    _, deltas, n = run('<tool_call>\n{"name": "add", "arguments": {"a": 1', step=3)
    assert n == 1 and calls(deltas) == [("call_0", "add", '{"a": 1')]


def test_without_parallel_calls_only_the_first_call_is_kept() -> None:
    text = f"<tool_call>{ADD}</tool_call>\n<tool_call>{WEATHER}</tool_call> trailing"
    content, deltas, n = run(text, step=7, parallel=False)
    assert (content, n) == ("", 1)
    assert [c[1] for c in calls(deltas)] == ["add"]


@pytest.mark.parametrize("step", [0, 1, 6])
def test_bare_json_calls_of_a_required_choice(step: int) -> None:
    content, deltas, n = run(f"[{ADD}, {WEATHER}]", step=step, bare_json=True)
    assert (content, n) == ("", 2)
    assert [c[1] for c in calls(deltas)] == ["add", "get_weather"]
    content, deltas, n = run(f"  {ADD}", step=step, bare_json=True)
    assert (content, n) == ("", 1) and calls(deltas) == [("call_0", "add", '{"a": 1, "b": 2}')]
    _, deltas, n = run(f"[{ADD}, {WEATHER}]", step=step, bare_json=True, parallel=False)
    assert n == 1 and calls(deltas)[0][1] == "add"


def test_bare_json_is_only_read_when_the_choice_forces_calls() -> None:
    assert run(ADD, step=3) == (ADD, [], 0)  # auto: JSON text is an answer, not a call
    assert run('{"x": 1}', step=3, bare_json=True) == ('{"x": 1}', [], 0)  # no call object: content


def test_whitespace_between_and_after_calls_is_dropped_but_text_after_a_call_is_kept() -> None:
    content, _, n = run(f"\n\n<tool_call>{ADD}</tool_call>\n\nDone.\n", step=2)
    assert (content, n) == ("Done.", 1)


def test_call_ids_look_like_openais() -> None:
    ids = {new_call_id() for _ in range(50)}
    assert len(ids) == 50
    assert all(i.startswith("call_") and len(i) == 29 and i[5:].isalnum() for i in ids)


@pytest.mark.parametrize("step", [0, 1, 4])
@pytest.mark.parametrize(
    ("text", "kw", "expected"),
    [
        # cut inside the arguments: the call keeps what was streamed
        (f"[{ADD}, " + '{"name": "get_weather", "arguments": {"city": "Par', {}, ["add", "get_weather"]),
        # cut after the name, before the arguments began: the call, with empty arguments
        (f"[{ADD}, " + '{"name": "get_weather", "argu', {}, ["add", "get_weather"]),
        (f"[{ADD}, " + '{"name": "get_weather"', {}, ["add", "get_weather"]),
        # cut inside the name (or before it): the unfinished call is dropped, never content
        (f"[{ADD}, " + '{"name": "get_wea', {}, ["add"]),
        (f"[{ADD}, " + '{"na', {}, ["add"]),
        (f"[{ADD}, " + "{", {}, ["add"]),
        (f"[{ADD}, ", {}, ["add"]),
        ("[", {}, []),
        ('{"name": "ad', {}, []),
    ],
)
def test_an_output_cut_inside_a_call_ends_it_as_a_call_never_as_content(
    text: str, kw: dict[str, object], expected: list[str], step: int
) -> None:
    content, deltas, n = run(text, step=step, bare_json=True, **kw)
    assert content == ""
    assert [c[1] for c in calls(deltas)] == expected and n == len(expected)


@pytest.mark.parametrize("step", [0, 3])
def test_a_block_cut_short_is_a_call_or_nothing_never_content(step: int) -> None:
    content, deltas, _ = run('Checking. <tool_call>\n{"name": "add", "arg', step=step)
    assert content.strip() == "Checking." and calls(deltas) == [("call_0", "add", "")]
    for cut in ("<tool_call>\n", '<tool_call>\n{"name": "a'):
        content, deltas, n = run("Checking. " + cut, step=step)
        assert (content.strip(), deltas, n) == ("Checking.", [], 0)
    # a finished block that names no tool stays content, as before
    content, _, n = run('<tool_call>{"name": "nope"', step=step)
    assert n == 0 and content == '<tool_call>{"name": "nope"'
