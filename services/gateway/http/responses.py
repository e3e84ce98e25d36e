"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``: OpenAI's Responses API over one Chat turn.

A request becomes the one turn of a gRPC Chat call to the gateway: ``instructions`` as a system
message, then the stored conversation of ``previous_response_id`` (its inputs and outputs, not its
instructions, as OpenAI does), then ``input`` (a string, or a list of items: text messages,
``function_call`` items (an assistant message's tool calls) and ``function_call_output`` items
(``tool`` messages)). ``tools`` (Responses' flat function tools), ``tool_choice`` and
``parallel_tool_calls`` become the turn's tools (openai_request.py's ``_tools`` on the chat shape);
``text.format`` (``json_object``, ``json_schema``) its ``SamplingParams.structured`` (the checks of
services/common/constraints.py, so a bad schema is a 400 naming ``text.format``); ``top_logprobs`` with
``include: ["message.output_text.logprobs"]`` its logprobs.

The answer is a ``response`` object whose output is a ``message`` item for the answer's text and one
``function_call`` item per tool call, in the order the model produced them; or (``stream``) the
Responses events in OpenAI's order: ``response.created``, ``response.in_progress``, then per item
``response.output_item.added``, for a message ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``, ``response.content_part.done``, for a
function call ``response.function_call_arguments.delta``..., ``response.function_call_arguments.done``,
then ``response.output_item.done``; last ``response.completed`` (or ``response.incomplete`` when
``max_output_tokens`` cut it short). An error after the stream started is an ``error`` event.

Stored responses (``store``, default true) are kept in Redis per tenant for ``responses_ttl_s``
(services/store/responses.py). The adapter never knows the tenant: the gateway, which authenticates,
sends back its digest (``x-meshserve-tenant-scope``: the Chat call's response headers, or the
trailers of a ListModels call for GET and DELETE), and records live under it, so another tenant's id
is simply not found (404). Without a Redis URL nothing is stored and ``previous_response_id`` is
refused.

Refused (400 naming the field): tools other than functions (``web_search``, ``file_search``, ...), and
the fields of features meshserve does not have (``background``, ``conversation``, ``prompt``,
``include`` other than ``message.output_text.logprobs``, ``reasoning``, ``truncation: auto``).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from aiohttp import web

from services.common import metadata as md
from services.common.constraints import Constraint, check_constraint, json_schema_constraint
from services.common.errors import InvalidArgument, MeshError, NotFound, PermissionDenied
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.sampling import MAX_TOP_LOGPROBS
from services.common.sampling_pb import structured_to_pb
from services.common.status_errors import Upstream, from_rpc_error
from services.gateway.http import openai_reply, openai_request, streams
from services.store.responses import ResponseStore

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")
MAX_METADATA_KEYS = 16
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_ID = re.compile(r"^resp_[0-9a-f]{1,64}$")
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
    temperature: float = 1.0
    top_p: float = 1.0
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


def _function_call(item: dict[str, Any], where: str, messages: list[dict[str, Any]]) -> None:
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
            _function_call(item, where, messages)
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
    temperature = openai_request._number(body, "temperature", 1.0)
    top_p = openai_request._number(body, "top_p", 0.0)
    sampling = pb.SamplingParams(max_tokens=max_output or 0, temperature=temperature, top_p=top_p)
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
        top_p=top_p or 1.0,
        max_output_tokens=max_output,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        tool_turn=tool_turn,
        text_format=text_format,
        top_logprobs=top_logprobs,
    )


def _usage(final: pb.Final | None) -> dict[str, Any] | None:
    if final is None:
        return None
    u = final.usage
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def _incomplete(final: pb.Final | None) -> bool:
    return final is not None and final.finish_reason == pb.FINISH_REASON_LENGTH


def output_message(message_id: str, text: str | None, status: str, logprobs: list[Any] | None = None) -> dict[str, Any]:
    """An assistant message output item (no content yet while ``text`` is None)."""
    content = [] if text is None else [output_text(text, logprobs)]
    return {"id": message_id, "type": "message", "status": status, "role": "assistant", "content": content}


def output_text(text: str, logprobs: list[Any] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def function_call(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    """A ``function_call`` output item (its ``id``: the call's id with OpenAI's ``fc_`` prefix)."""
    item_id = "fc_" + call_id.removeprefix("call_")
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def response_object(
    request: ResponsesRequest,
    response_id: str,
    model: str,
    created: int,
    *,
    output: list[dict[str, Any]] | None = None,
    final: pb.Final | None = None,
) -> dict[str, Any]:
    """The ``response`` object: in progress (no ``final``) or finished with its ``output`` items."""
    if final is None:
        status, items = "in_progress", []
    else:
        status = "incomplete" if _incomplete(final) else "completed"
        items = output or []
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "model": model,
        "output": items,
        "parallel_tool_calls": request.parallel_tool_calls,
        "previous_response_id": request.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": request.store,
        "temperature": request.temperature,
        "text": {"format": request.text_format},
        "tool_choice": request.tool_choice,
        "tools": request.tools,
        "top_logprobs": request.top_logprobs,
        "top_p": request.top_p,
        "truncation": "disabled",
        "usage": _usage(final),
        "user": None,
        "metadata": request.metadata,
    }


class _Output:
    """The output items of one answer, built from its frames in the order the model produced them: a
    ``message`` item for a run of text, a ``function_call`` item per tool call. With ``events`` each step
    is also streamed as OpenAI streams it."""

    def __init__(self, response_id: str, events: _Events | None, with_logprobs: bool) -> None:
        self.items: list[dict[str, Any]] = []
        self._events = events
        self._message_id = _message_id(response_id)
        self._with_logprobs = with_logprobs
        self._open: dict[str, Any] | None = None
        self._texts: list[str] = []
        self._logprobs: list[dict[str, Any]] = []
        self._calls: dict[int, tuple[int, dict[str, Any]]] = {}
        """Tool-call index -> (output index, item)."""
        self._messages = 0

    async def _send(self, kind: str, **payload: Any) -> None:
        if self._events is not None:
            await self._events.send(kind, **payload)

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"output_index": len(self.items) - 1, "item_id": self._open["id"]}

    async def text(self, delta: str, entries: Sequence[pb.TokenLogprob]) -> None:
        logprobs = openai_reply.chat_logprobs(entries)["content"] if self._with_logprobs and entries else []
        if not delta:
            if logprobs and self._open is not None and self._open["type"] == "message":
                self._logprobs.extend(logprobs)
            return
        if self._open is None or self._open["type"] != "message":
            await self._open_message()
        self._texts.append(delta)
        self._logprobs.extend(logprobs)
        await self._send("response.output_text.delta", **self._where(), content_index=0, delta=delta, logprobs=logprobs)

    async def _open_message(self) -> None:
        await self._close("completed")
        suffix = f"_{self._messages}" if self._messages else ""
        self._messages += 1
        self._open = output_message(self._message_id + suffix, None, "in_progress")
        self.items.append(self._open)
        self._texts, self._logprobs = [], []
        await self._send("response.output_item.added", output_index=len(self.items) - 1, item=self._open)
        await self._send("response.content_part.added", **self._where(), content_index=0, part=output_text(""))

    async def call(self, delta: pb.ToolCallDelta) -> None:
        if delta.id:
            await self._close("completed")
            self._open = function_call(delta.id, delta.name, "", "in_progress")
            self.items.append(self._open)
            self._calls[delta.index] = (len(self.items) - 1, self._open)
            await self._send("response.output_item.added", output_index=len(self.items) - 1, item=self._open)
        if delta.index not in self._calls:
            raise MeshError("a tool call's arguments came before its name; retry, and report it if it persists")
        index, item = self._calls[delta.index]
        if delta.arguments:
            item["arguments"] += delta.arguments
            await self._send(
                "response.function_call_arguments.delta", output_index=index, item_id=item["id"], delta=delta.arguments
            )

    async def _close(self, status: str) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        where = {"output_index": next(i for i, x in enumerate(self.items) if x is item), "item_id": item["id"]}
        item["status"] = status
        if item["type"] == "message":
            text = "".join(self._texts)
            part = output_text(text, self._logprobs)
            item["content"] = [part]
            await self._send("response.output_text.done", **where, content_index=0, text=text, logprobs=self._logprobs)
            await self._send("response.content_part.done", **where, content_index=0, part=part)
        else:
            await self._send("response.function_call_arguments.done", **where, arguments=item["arguments"])
        await self._send("response.output_item.done", output_index=where["output_index"], item=item)

    async def finish(self, status: str) -> None:
        """Closes the last item with the answer's ``status``; an answer of nothing is one empty message."""
        if not self.items:
            await self._open_message()
        await self._close(status)

    def conversation(self) -> list[dict[str, Any]]:
        """The answer as chat messages, for the stored conversation."""
        messages: list[dict[str, Any]] = []
        for item in self.items:
            if item["type"] == "message":
                messages.append({"role": "assistant", "content": item["content"][0]["text"]})
            else:
                _function_call(item, "output", messages)
        return messages


def _message_id(response_id: str) -> str:
    return "msg_" + response_id.removeprefix("resp_")


def not_found(response_id: str) -> NotFound:
    return NotFound(
        f"no response with id {openai_request._show(response_id)} (never stored, expired, deleted, or another tenant's)"
    )


class ResponseRoutes:
    """The handlers, over the adapter's shared request plumbing (:class:`~.app.OpenAIApp`) and the store."""

    def __init__(self, app: Any, store: ResponseStore | None) -> None:
        self._app = app
        self._store = store

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{response_id}", self.retrieve)
        app.router.add_delete("/v1/responses/{response_id}", self.delete)

    async def _scope(self, request: web.Request) -> str:
        """The caller's tenant digest, from the trailers of a ListModels call (it authenticates)."""
        call = self._app._gateway.ListModels(pb.ListModelsRequest(), metadata=self._app._metadata(request))
        await call
        scope = streams.header(await call.trailing_metadata(), md.TENANT_SCOPE)
        if scope is None:
            raise PermissionDenied("this credential may not use /v1/responses: it needs the inference scope")
        return scope

    def _require_store(self) -> ResponseStore:
        if self._store is None:
            raise InvalidArgument(
                "this server keeps no responses (the HTTP adapter has no Redis: MESHSERVE_GATEWAY_HTTP_REDIS_URL);"
                " send the whole conversation in 'input' instead of previous_response_id"
            )
        return self._store

    async def retrieve(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        store = self._require_store()
        scope = await self._scope(request)
        record = await store.get(scope, response_id) if _ID.match(response_id) else None
        if record is None:
            raise not_found(response_id)
        return web.json_response(record["response"])

    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        store = self._require_store()
        scope = await self._scope(request)
        if not (_ID.match(response_id) and await store.delete(scope, response_id)):
            raise not_found(response_id)
        return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})

    async def create(self, request: web.Request) -> web.StreamResponse:
        parsed = parse(await self._app._json(request))
        if parsed.previous_response_id is not None:
            self._require_store()
        call = self._app._gateway.Chat(metadata=self._app._metadata(request))
        try:
            headers = await call.initial_metadata()
            scope = streams.header(headers, md.TENANT_SCOPE)
            if scope is None:  # the gateway refused the call: its status says why
                await call.read()
                raise MeshError("the gateway sent no tenant for this call; retry, and report it if it persists")
            request_id = streams.header(headers, md.REQUEST_ID) or ""
            history: list[dict[str, Any]] = []
            if parsed.previous_response_id is not None:
                assert self._store is not None
                previous = None
                if _ID.match(parsed.previous_response_id):
                    previous = await self._store.get(scope, parsed.previous_response_id)
                if previous is None:
                    raise not_found(parsed.previous_response_id)
                history = list(previous["conversation"])
            conversation = [*history, *parsed.messages]
            await call.write(pb.ChatRequest(turn=_turn(parsed, conversation)))
            await call.done_writing()
            frames = streams.chat_frames(call)
            first = await anext(frames, None)
            model = await self._app._served_model(parsed.model, request)
            response_id = "resp_" + request_id
            created = int(time.time())
            with_logprobs = parsed.sampling.logprobs
            if not parsed.stream:
                out = _Output(response_id, None, with_logprobs)
                final = await _answer(first, frames, out)
                body = response_object(parsed, response_id, model, created, output=out.items, final=final)
                await self._keep(parsed, scope, response_id, body, [*conversation, *out.conversation()])
                return web.json_response(body, headers={md.REQUEST_ID: request_id})
            events = _Events(await streams.sse_start(request, request_id))
            try:
                pending = response_object(parsed, response_id, model, created)
                await events.send("response.created", response=pending)
                await events.send("response.in_progress", response=pending)
                out = _Output(response_id, events, with_logprobs)
                end = await _answer(first, frames, out)
                body = response_object(parsed, response_id, model, created, output=out.items, final=end)
                await self._keep(parsed, scope, response_id, body, [*conversation, *out.conversation()])
                await events.send(f"response.{body['status']}", response=body)
            except (MeshError, grpc.aio.AioRpcError) as exc:
                error = exc if isinstance(exc, MeshError) else from_rpc_error(exc, Upstream.ROUTER)
                await events.send("error", code=error.code.lower(), message=error.message, param=None)
            await events.response.write_eof()
            return events.response
        finally:
            call.cancel()

    async def _keep(
        self,
        parsed: ResponsesRequest,
        scope: str,
        response_id: str,
        body: dict[str, Any],
        conversation: list[dict[str, Any]],
    ) -> None:
        if parsed.store and self._store is not None:
            await self._store.put(scope, response_id, {"response": body, "conversation": conversation})


def _turn(parsed: ResponsesRequest, conversation: list[dict[str, Any]]) -> pb.ChatTurn:
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


async def _answer(first: streams.Frame | None, frames: AsyncIterator[streams.Frame], out: _Output) -> pb.Final:
    """Feeds the turn's frames to ``out`` and closes it; the final frame."""
    final = None
    async for text, last, calls, _, logprobs in streams.prepend(first, frames):
        final = last or final
        await out.text(text, logprobs)
        for delta in calls:
            await out.call(delta)
    if final is None:
        raise MeshError("the stream ended without a final frame; retry, and report it if it persists")
    await out.finish("incomplete" if _incomplete(final) else "completed")
    return final


class _Events:
    """The SSE events of one streamed response, numbered (``sequence_number``) as OpenAI numbers them."""

    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response
        self._sequence = 0

    async def send(self, kind: str, **payload: Any) -> None:
        data = {"type": kind, "sequence_number": self._sequence, **payload}
        self._sequence += 1
        line = json.dumps(data, separators=(",", ":"))
        await self.response.write(f"event: {kind}\ndata: {line}\n\n".encode())
