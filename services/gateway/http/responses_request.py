"""OpenAI Responses request JSON -> our types (``POST /v1/responses``): :func:`parse` checks a body into a
:class:`ResponsesRequest`; :func:`chat_turn` makes it, after the stored conversation, the one turn of a
gRPC Chat call. No transport here; the answer is built in :mod:`.responses_reply`, the routes are
:mod:`.responses` (the three were one module, responses.py, until this split).

The turn holds ``instructions`` as a system message, then the stored conversation of
``previous_response_id`` (its inputs and outputs, not its instructions, as OpenAI does), then ``input``
(a string, or a list of items: text messages, ``function_call`` items (an assistant message's tool
calls) and ``function_call_output`` items (``tool`` messages)). ``tools`` (Responses' flat function
tools), ``tool_choice`` and ``parallel_tool_calls`` become the turn's tools (openai_request.py's
``_tools`` on the chat shape); ``text.format`` (``json_object``, ``json_schema``) its
``SamplingParams.structured`` (the checks of services/common/constraints.py, so a bad schema is a 400
naming ``text.format``); ``top_logprobs`` with ``include: ["message.output_text.logprobs"]`` its logprobs.

Refused (400 naming the field): tools other than functions (``web_search``, ``file_search``, ...), and
the fields of features meshserve does not have (``background``, ``conversation``, ``prompt``,
``include`` other than ``message.output_text.logprobs``, ``reasoning``, ``truncation: auto``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.common.constraints import Constraint, check_constraint, json_schema_constraint
from services.common.errors import InvalidArgument
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.sampling import MAX_TOP_LOGPROBS
from services.common.sampling_pb import structured_to_pb
from services.gateway.http import openai_request

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")
MAX_METADATA_KEYS = 16
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_NEUTRAL: tuple[tuple[str, tuple[object, ...], str], ...] = (
    # (field, values that change nothing, why it is refused otherwise)
    ("background", (False,), "background responses are not supported"),
    ("conversation", (), "conversations are not supported; chain responses with previous_response_id"),
    ("prompt", (), "prompt templates are not supported"),
    ("reasoning", ({},), "reasoning options are not supported"),
    ("truncation", ("disabled",), "only truncation 'disabled' is supported"),
    ("max_tool_calls", (), "max_tool_calls is not supported (tool_choice 'none' allows no calls)"),
)


@dataclass
class ResponsesRequest:
    """A parsed Responses request."""

    model: str
    messages: list[dict[str, Any]]
    """The new input as chat messages (openai_request.py's chat shape: role, content, tool_calls, tool_call_id)."""
    instructions: str | None
    sampling: pb.SamplingParams
    stream: bool
    store: bool
    previous_response_id: str | None
    metadata: dict[str, str] = field(default_factory=dict)
    temperature: float | None = None
    """As sent; None: the model's default applies (echoed as null)."""
    top_p: float | None = None
    max_output_tokens: int | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    """The function tools, echoed in the response (Responses' FunctionTool shape)."""
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    tool_turn: pb.ChatTurn = field(default_factory=pb.ChatTurn)
    """The turn's ``tools`` and ``tool_choice`` (no messages): copied into the Chat turn."""
    text_format: dict[str, Any] = field(default_factory=lambda: {"type": "text"})
    top_logprobs: int = 0


def _text_format(body: dict[str, Any]) -> tuple[dict[str, Any], Constraint | None]:
    """``text.format``: ``text`` (none), ``json_object``, or ``json_schema`` (``name``, ``schema``,
    ``strict``, ``description``; flat, unlike chat's ``response_format``). The output is held to the
    schema whatever ``strict`` says, as on the chat path. Returns the format to echo and the constraint."""
    text = body.get("text")
    if text is None:
        return {"type": "text"}, None
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or (fmt is not None and not isinstance(fmt, dict)):
        raise InvalidArgument("'text' must be an object such as {'format': {'type': 'json_object'}}")
    kind = (fmt or {}).get("type", "text")
    if fmt is None or kind == "text":
        return {"type": "text"}, None
    if kind == "json_object":
        return {"type": "json_object"}, check_constraint("json_object", field="text.format")
    if kind != "json_schema":
        raise InvalidArgument(
            f"'text.format' of type {openai_request._show(kind)} is not supported;"
            " use 'text', 'json_object' or 'json_schema'"
        )
    name = fmt.get("name")
    if not isinstance(name, str) or not 1 <= len(name) <= 64:
        raise InvalidArgument("'text.format.name' must be a string of 1 to 64 characters")
    strict = fmt.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidArgument("'text.format.strict' must be true or false")
    description = fmt.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidArgument("'text.format.description' must be a string")
    schema = fmt.get("schema")
    if schema is None:
        raise InvalidArgument("'text.format.schema' is missing; send the JSON Schema object")
    constraint = json_schema_constraint(schema, field="text.format.schema")
    echo = {"type": "json_schema", "name": name, "schema": schema, "strict": strict, "description": description}
    return echo, constraint


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]], str | dict[str, Any], bool, pb.ChatTurn]:
    """Responses' ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked here under their
    Responses names, then put into a turn by the chat path's ``_tools`` (the router checks the limits).
    Returns the tools, choice and parallel flag to echo, and the turn holding them."""
    tools = body.get("tools")
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise InvalidArgument("'tools' must be a list of {'type': 'function', 'name': ..., 'parameters': {...}}")
    echo: list[dict[str, Any]] = []
    chat: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise InvalidArgument(
                f"'tools[{i}]' of type {openai_request._show(kind)} is not supported by meshserve; only function tools"
                " {'type': 'function', 'name': ..., 'parameters': {...}} are"
            )
        assert isinstance(tool, dict)
        name = tool.get("name")
        if not isinstance(name, str):
            raise InvalidArgument(f"'tools[{i}].name' must be a string: the function's name")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidArgument(f"'tools[{i}].description' must be a string")
        parameters = tool.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidArgument(f"'tools[{i}].parameters' must be a JSON Schema object")
        strict = tool.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidArgument(f"'tools[{i}].strict' must be true or false")
        function = {"name": name, "description": description, "parameters": parameters}
        chat.append({"type": "function", "function": function})
        echo.append({"type": "function", **function, "strict": strict})
    choice = body.get("tool_choice")
    chat_choice: object = choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InvalidArgument(
                "'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}"
                " (only function tools are supported)"
            )
        chat_choice = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None and choice not in ("auto", "none", "required"):
        raise InvalidArgument("'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}")
    parallel = body.get("parallel_tool_calls")
    turn = pb.ChatTurn()
    openai_request._tools({"tools": chat, "tool_choice": chat_choice, "parallel_tool_calls": parallel}, turn)
    shown: str | dict[str, Any] = choice if choice is not None else "auto"
    if isinstance(choice, dict):
        shown = {"type": "function", "name": choice["name"]}
    return echo, shown, parallel is not False, turn


def _logprobs(body: dict[str, Any], sampling: pb.SamplingParams) -> int:
    """``include`` (only ``message.output_text.logprobs``) and ``top_logprobs`` (0 to 20, needs it)."""
    include = body.get("include")
    if include is None:
        include = []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise InvalidArgument(f"'include' must be a list of strings such as [{LOGPROBS_INCLUDE!r}]")
    other = [x for x in include if x != LOGPROBS_INCLUDE]
    if other:
        raise InvalidArgument(
            f"'include' value {openai_request._show(other[0])} is not supported by meshserve;"
            f" only {LOGPROBS_INCLUDE!r} is"
        )
    top = openai_request._int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    wanted = LOGPROBS_INCLUDE in include
    if top and not wanted:
        raise InvalidArgument(
            f"'top_logprobs' needs 'include': [{LOGPROBS_INCLUDE!r}] to return them; add it or drop top_logprobs"
        )
    sampling.logprobs = wanted
    sampling.top_logprobs = top
    return top


def _content(item: dict[str, Any], where: str, name: str = "content") -> str:
    content = item.get(name)
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidArgument(f"'{where}.{name}' must be a string or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise InvalidArgument(
                f"'{where}.{name}[{j}]' of type {openai_request._show(kind)} is not supported; send text parts"
                " {'type': 'input_text', 'text': ...} (images, audio and files are not supported)"
            )
        parts.append(part["text"])
    return "".join(parts)


def _field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"'{where}.{name}' must be a non-empty string")
    return value


def append_function_call(item: dict[str, Any], where: str, messages: list[dict[str, Any]]) -> None:
    """A ``function_call`` item: a call of the assistant's, joined to the assistant message just before it
    (a message with text, or the calls before it: parallel calls are one chat message)."""
    arguments = item.get("arguments")
    if not isinstance(arguments, str):
        raise InvalidArgument(f"'{where}.arguments' must be a string: the call's JSON arguments")
    call = {
        "id": _field(item, "call_id", where),
        "type": "function",
        "function": {"name": _field(item, "name", where), "arguments": arguments},
    }
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant":
        last = {"role": "assistant", "content": ""}
        messages.append(last)
    last.setdefault("tool_calls", []).append(call)


def _input(value: object) -> list[dict[str, Any]]:
    if isinstance(value, str):
        if not value:
            raise InvalidArgument("'input' is an empty string; send some text")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidArgument("'input' must be a string or a non-empty list of messages {'role': ..., 'content': ...}")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidArgument(f"'{where}' must be a message object {{'role': ..., 'content': ...}}")
        kind = item.get("type", "message")
        if kind == "function_call":
            append_function_call(item, where, messages)
            continue
        if kind == "function_call_output":
            output = _content(item, where, "output")
            messages.append({"role": "tool", "content": output, "tool_call_id": _field(item, "call_id", where)})
            continue
        if kind != "message":
            raise InvalidArgument(
                f"'{where}.type' is {openai_request._show(kind)}; only 'message', 'function_call' and"
                " 'function_call_output' items are supported"
            )
        role = item.get("role")
        if role not in ROLES:
            raise InvalidArgument(f"'{where}.role' must be 'user', 'assistant', 'system' or 'developer'")
        messages.append({"role": ROLES[role], "content": _content(item, where)})
    return messages


def _metadata(value: object) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_METADATA_KEYS:
        raise InvalidArgument(f"'metadata' must be an object of at most {MAX_METADATA_KEYS} string values")
    for key, item in value.items():
        if not isinstance(item, str) or len(key) > 64 or len(item) > 512:
            raise InvalidArgument("'metadata' values must be strings of at most 512 characters, keys at most 64")
    return dict(value)


def parse(body: dict[str, Any]) -> ResponsesRequest:
    """A Responses request body, checked (JSON types; ranges are the gateway's)."""
    openai_request._refuse_unsupported(body, _NEUTRAL)
    model = body.get("model", "")
    if not isinstance(model, str):
        raise InvalidArgument("'model' must be a string; GET /v1/models lists the served models")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidArgument("'instructions' must be a string")
    for name in ("stream", "store"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise InvalidArgument(f"'{name}' must be true or false")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise InvalidArgument("'previous_response_id' must be a string: the id of an earlier response")
    max_output = openai_request._int(body, "max_output_tokens", 1)
    # Omitted: unset, for the served model's generation defaults (echoed as null).
    sampling = pb.SamplingParams(max_tokens=max_output or 0)
    temperature = top_p = None
    if body.get("temperature") is not None:
        sampling.temperature = temperature = openai_request._number(body, "temperature")
    if body.get("top_p") is not None:
        sampling.top_p = top_p = openai_request._number(body, "top_p")
    text_format, structured = _text_format(body)
    if structured is not None:
        sampling.structured.CopyFrom(structured_to_pb(structured))
    top_logprobs = _logprobs(body, sampling)
    tools, tool_choice, parallel, tool_turn = _tools(body)
    return ResponsesRequest(
        model=model,
        messages=_input(body.get("input")),
        instructions=instructions or None,
        sampling=sampling,
        stream=bool(body.get("stream", False)),
        store=body.get("store", True) is not False,
        previous_response_id=previous,
        metadata=_metadata(body.get("metadata")),
        temperature=temperature,
        top_p=None if top_p is None else top_p or 1.0,
        max_output_tokens=max_output,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        tool_turn=tool_turn,
        text_format=text_format,
        top_logprobs=top_logprobs,
    )


def chat_turn(parsed: ResponsesRequest, conversation: list[dict[str, Any]]) -> pb.ChatTurn:
    """The Chat turn: the request's tools and sampling, ``instructions``, then the conversation (chat-shaped
    messages; a ``tool`` message gets the name of the function whose call it answers)."""
    turn = pb.ChatTurn()
    turn.CopyFrom(parsed.tool_turn)
    turn.model = parsed.model
    turn.sampling.CopyFrom(parsed.sampling)
    if parsed.instructions:
        turn.messages.add(role="system", content=parsed.instructions)
    names: dict[str, str] = {}
    for i, message in enumerate(conversation):
        for tool_call in message.get("tool_calls", ()):
            names[tool_call["id"]] = tool_call["function"]["name"]
        if message["role"] == "tool" and "name" not in message:
            message = {**message, "name": names.get(message.get("tool_call_id", ""), "")}
        openai_request._message(message, i, turn)
    return turn
