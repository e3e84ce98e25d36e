"""Tools of a chat turn in domain types: the functions, the caller's choice, the calls, their limits,
and the one place that turns (tools, tool_choice) into the constraint the generation must obey.

No transport here: services/router/frontend/convert.py builds these from ``meshserve.v1`` protos (the gateway's
HTTP adapter builds the protos from OpenAI JSON). Rendering the tools into the prompt is the
tokenizer's (services/common/chat_tools.py); parsing the model's output into calls is
services/router/frontend/tool_parser.py's, on the router, so gRPC and HTTP callers get the same calls.

Every limit is a module constant; a turn over one is INVALID_ARGUMENT naming the field and the limit.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from services.common.chat_tools import CALL_CLOSE, CALL_OPEN
from services.common.constraints import Constraint, Kind
from services.common.errors import InvalidArgument
from services.common.sampling import SamplingParams

MAX_TOOLS = 128
"""Most tools per turn (OpenAI's limit)."""
MAX_TOOL_NAME_CHARS = 64
"""Longest function name (OpenAI's); names are letters, digits, ``_`` and ``-``."""
MAX_TOOL_DESCRIPTION_CHARS = 8192
"""Longest function description, in characters."""
MAX_TOOL_PARAMETERS_CHARS = 16384
"""Longest parameters schema of one tool, as JSON text."""
MAX_TOOL_SCHEMA_DEPTH = 16
"""Deepest nesting of objects and arrays in a parameters schema (bounds the constraint's compile)."""
MAX_TOOLS_CHARS = 131072
"""Most characters of descriptions and parameter schemas of all of a turn's tools together."""
MAX_TOOL_CALLS = 128
"""Most tool calls in one assistant message of the conversation."""
MAX_TOOL_CALL_ID_CHARS = 256
"""Longest tool call id (``tool_call_id`` of a tool message, ``id`` of an assistant's call)."""
MAX_TOOL_ARGUMENTS_CHARS = 32768
"""Longest arguments text of one call in an assistant message of the conversation."""

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class ToolChoiceMode(StrEnum):
    """OpenAI's ``tool_choice``: ``auto``, ``none``, ``required``, or one named function."""

    AUTO = "auto"
    NONE = "none"
    REQUIRED = "required"
    FUNCTION = "function"


@dataclass(frozen=True)
class Tool:
    """A function the model may call."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """The parameters' JSON Schema (an object schema; empty: takes no parameters)."""

    def openai(self) -> dict[str, Any]:
        """As OpenAI's ``tools[]`` entry, which chat templates (and the fallback rendering) take."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters) if self.parameters else {"type": "object", "properties": {}}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """Whether and how the model calls the turn's tools."""

    mode: ToolChoiceMode = ToolChoiceMode.AUTO
    function_name: str = ""
    """``FUNCTION``: the tool the model must call."""
    parallel: bool = True
    """Whether an answer may hold more than one call (OpenAI's ``parallel_tool_calls``)."""


NO_TOOLS = ToolChoice(ToolChoiceMode.NONE)


@dataclass(frozen=True)
class ToolCall:
    """A call the assistant made (in the conversation of a later turn)."""

    id: str
    name: str
    arguments: str
    """JSON text."""


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a call as OpenAI streams it: the first of a call has ``id`` and ``name``; the rest
    only the next fragment of ``arguments``."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


CONSTRAINT_APPLIED = True
"""Whether :func:`constrained` applies :func:`tool_constraint` to a turn's sampling (it does: the
structured-output machinery, ``SamplingParams.structured``, holds the generation to it)."""


@dataclass(frozen=True)
class ToolConstraint:
    """What the generation of a turn must match so that its calls parse and fit their schemas.

    ``kind`` is ``"json_schema"`` (``value`` a JSON Schema, JSON text: the whole output is that JSON)
    or ``"grammar"`` (``value`` a Lark grammar in llguidance's dialect, with ``%json`` for the calls).
    """

    kind: str
    value: str


def _depth(value: Any, limit: int, level: int = 0) -> int:
    if level > limit:
        return level
    if isinstance(value, dict):
        return max((_depth(v, limit, level + 1) for v in value.values()), default=level + 1)
    if isinstance(value, list):
        return max((_depth(v, limit, level + 1) for v in value), default=level + 1)
    return level


def parse_parameters(text: str, where: str) -> dict[str, Any]:
    """A tool's parameters schema from JSON text, checked (``where`` names the field in errors)."""
    if not text:
        return {}
    if len(text) > MAX_TOOL_PARAMETERS_CHARS:
        raise InvalidArgument(
            f"{where} is {len(text)} characters of JSON, above the limit of {MAX_TOOL_PARAMETERS_CHARS}; shorten it"
        )
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError):
        raise InvalidArgument(f"{where} is not valid JSON; send a JSON Schema object") from None
    if not isinstance(schema, dict):
        raise InvalidArgument(f"{where} must be a JSON Schema object such as {{'type': 'object', 'properties': {{}}}}")
    if schema.get("type", "object") != "object":
        raise InvalidArgument(f"{where} must describe an object ('type': 'object'), got type {schema.get('type')!r}")
    if _depth(schema, MAX_TOOL_SCHEMA_DEPTH) > MAX_TOOL_SCHEMA_DEPTH:
        raise InvalidArgument(f"{where} is nested more than {MAX_TOOL_SCHEMA_DEPTH} levels deep; flatten the schema")
    return schema


def check_tools(tools: Sequence[Tool], choice: ToolChoice) -> None:
    """A turn's tools and tool choice against the limits; raises InvalidArgument naming the field."""
    if len(tools) > MAX_TOOLS:
        raise InvalidArgument(f"tools has {len(tools)} entries; send at most {MAX_TOOLS}")
    seen: set[str] = set()
    total = 0
    for i, tool in enumerate(tools):
        if not _NAME.fullmatch(tool.name):
            raise InvalidArgument(
                f"tools[{i}].function.name {tool.name[:70]!r} must be 1 to {MAX_TOOL_NAME_CHARS} letters, digits, "
                "'_' or '-'"
            )
        if tool.name in seen:
            raise InvalidArgument(f"tools[{i}].function.name {tool.name!r} appears twice; tool names must be unique")
        seen.add(tool.name)
        if len(tool.description) > MAX_TOOL_DESCRIPTION_CHARS:
            raise InvalidArgument(
                f"tools[{i}].function.description is {len(tool.description)} characters, above the limit of "
                f"{MAX_TOOL_DESCRIPTION_CHARS}; shorten it"
            )
        total += len(tool.description) + (len(json.dumps(tool.parameters)) if tool.parameters else 0)
    if total > MAX_TOOLS_CHARS:
        raise InvalidArgument(
            f"tools hold {total} characters of descriptions and parameters, above the limit of {MAX_TOOLS_CHARS}; "
            "send fewer or shorter tools"
        )
    if choice.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.FUNCTION) and not tools:
        raise InvalidArgument(f"tool_choice is {choice.mode.value!r} but the request has no tools; send tools")
    if choice.mode is ToolChoiceMode.FUNCTION and choice.function_name not in seen:
        raise InvalidArgument(
            f"tool_choice names function {choice.function_name[:70]!r}, which is not among the request's tools; "
            "name one of tools[].function.name"
        )


def check_tool_call(call: ToolCall, where: str) -> None:
    """An assistant message's call (the conversation sent back) against the limits."""
    if len(call.id) > MAX_TOOL_CALL_ID_CHARS:
        raise InvalidArgument(f"{where}.id is longer than {MAX_TOOL_CALL_ID_CHARS} characters; send the id we sent")
    if not _NAME.fullmatch(call.name):
        raise InvalidArgument(f"{where}.function.name must be 1 to {MAX_TOOL_NAME_CHARS} letters, digits, '_' or '-'")
    if len(call.arguments) > MAX_TOOL_ARGUMENTS_CHARS:
        raise InvalidArgument(
            f"{where}.function.arguments is {len(call.arguments)} characters, above the limit of "
            f"{MAX_TOOL_ARGUMENTS_CHARS}"
        )


def effective_choice(tools: Sequence[Tool], choice: ToolChoice | None) -> ToolChoice:
    """The choice that applies: unset is ``auto`` with tools and ``none`` without."""
    if choice is None:
        return ToolChoice(ToolChoiceMode.AUTO) if tools else NO_TOOLS
    return choice if tools else NO_TOOLS


def calls_possible(tools: Sequence[Tool], choice: ToolChoice) -> bool:
    """Whether the turn's output is parsed for calls (never with ``none``, never without tools)."""
    return bool(tools) and choice.mode is not ToolChoiceMode.NONE


def prompt_tools(tools: Sequence[Tool], choice: ToolChoice) -> list[dict[str, Any]] | None:
    """The tools rendered into the prompt: none with ``tool_choice: none`` (the model is not invited
    to call what it may not call), only the named one with a named choice, else all."""
    if not calls_possible(tools, choice):
        return None
    if choice.mode is ToolChoiceMode.FUNCTION:
        return [t.openai() for t in tools if t.name == choice.function_name]
    return [t.openai() for t in tools]


def tools_key(tools: Sequence[Tool], choice: ToolChoice) -> str:
    """The part of the response-cache key for the turn's tools and choice ("" without tools, so keys of
    requests without tools are those they always were)."""
    if not tools and choice == NO_TOOLS:
        return ""
    body = {
        "tools": [t.openai() for t in tools],
        "choice": [choice.mode.value, choice.function_name, choice.parallel],
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _call_schema(tool: Tool) -> dict[str, Any]:
    parameters = dict(tool.parameters) if tool.parameters else {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _one_call_schema(tools: Sequence[Tool]) -> dict[str, Any]:
    schemas = [_call_schema(t) for t in tools]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance's JSON layout option (a keyword other JSON-schema tools ignore): the calls' JSON written as
``json.dumps`` writes it, as the prompt shows it, instead of whatever whitespace the model likes (the
135M model, left free, indents every key on a line of its own: tokens for nothing)."""


def _laid_out(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": _COMPACT}


def tool_constraint(tools: Sequence[Tool], choice: ToolChoice) -> ToolConstraint | None:
    """The constraint a turn's generation must obey for its calls to be valid (None: unconstrained).

    * ``none`` (or no tools): None.
    * a named function: JSON Schema of one call ``{"name": <const>, "arguments": <its parameters>}``;
      the whole output is that object.
    * ``required``: one call of any tool (``anyOf`` of the calls' schemas), or with parallel calls a
      JSON array of 1 or more of them.
    * ``auto``: a grammar: either text (not starting with ``<``) or one (parallel: one or more) call
      blocks ``<tool_call>\\n{call JSON}\\n</tool_call>`` as the prompt asks for them
      (services/common/chat_tools.py), each call's JSON held to its schema by ``%json``.

    Every call's JSON carries llguidance's ``x-guidance`` layout (:data:`_COMPACT`): compact, as
    ``json.dumps`` writes it. The output under each is what
    :class:`~services.router.frontend.tool_parser.ToolCallParser` parses (tests/unit/router/test_tools.py runs
    both over the model's vocabulary).
    """
    if not calls_possible(tools, choice):
        return None
    if choice.mode is ToolChoiceMode.FUNCTION:
        tool = next(t for t in tools if t.name == choice.function_name)
        return ToolConstraint("json_schema", json.dumps(_laid_out(_call_schema(tool))))
    one = _one_call_schema(tools)
    if choice.mode is ToolChoiceMode.REQUIRED:
        schema = {"type": "array", "items": one, "minItems": 1} if choice.parallel else one
        return ToolConstraint("json_schema", json.dumps(_laid_out(schema)))
    calls = 'call ("\\n" call)*' if choice.parallel else "call"
    grammar = "\n".join(
        (
            "start: TEXT | calls",
            f"calls: {calls}",
            f'call: "{CALL_OPEN}\\n" call_json "\\n{CALL_CLOSE}"',
            f"call_json: %json {json.dumps(_laid_out(one))}",
            "TEXT: /[^<](.|\\n)*/",
        )
    )
    return ToolConstraint("grammar", grammar)


def constrained(sampling: SamplingParams, tools: Sequence[Tool], choice: ToolChoice) -> SamplingParams:
    """``sampling`` with the turn's tool constraint applied (the one place the router applies it).

    A turn whose tool choice can call a tool gets :func:`tool_constraint` as its structured output
    (``json_schema`` or a Lark ``grammar``); the constraint then reaches the response-cache key through
    ``SamplingParams.canonical()``. A turn that also sets its own structured output is refused
    (INVALID_ARGUMENT naming both fields): one generation obeys one constraint. The constraint text is
    taken as built (not re-serialised with sorted keys: a call's ``name`` stays before its
    ``arguments``, so the name streams first) and is bounded by the tool limits above, not by the
    structured-output size limit; the worker compiles it within the usual time bound.
    """
    constraint = tool_constraint(tools, choice)
    if constraint is None:
        return sampling
    if sampling.structured is not None:
        raise InvalidArgument(
            "tools with tool_choice 'auto', 'required' or a named function cannot be combined with "
            "response_format (sampling.structured); send one or the other, or tool_choice 'none'"
        )
    kind: Kind = "json_schema" if constraint.kind == "json_schema" else "grammar"
    return replace(sampling, structured=Constraint(kind, constraint.value))
