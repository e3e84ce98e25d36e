"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``: OpenAI's Responses API over one Chat turn.

A request becomes the one turn of a gRPC Chat call to the gateway: ``instructions`` as a system
message, then the stored conversation of ``previous_response_id`` (its inputs and outputs, not its
instructions, as OpenAI does), then ``input`` (a string, or a list of text messages). The answer is
a ``response`` object with one output message, or (``stream``) the Responses events in OpenAI's
order: ``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``, then ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut it short); an error after the stream started
is an ``error`` event.

Stored responses (``store``, default true) are kept in Redis per tenant for ``responses_ttl_s``
(services/store/responses.py). The adapter never knows the tenant: the gateway, which authenticates,
sends back its digest (``x-meshserve-tenant-scope``: the Chat call's response headers, or the
trailers of a ListModels call for GET and DELETE), and records live under it, so another tenant's id
is simply not found (404). Without a Redis URL nothing is stored and ``previous_response_id`` is
refused.

Not yet supported (400 naming the field): ``tools`` and a ``text.format`` other than ``text``
(structured output and tool calls come with their own work), and the fields of features meshserve
does not have (``background``, ``conversation``, ``prompt``, ``include``, ``top_logprobs``,
``reasoning``, ``truncation: auto``).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from aiohttp import web

from services.common import metadata as md
from services.common.errors import InvalidArgument, MeshError, PermissionDenied
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.status_errors import Upstream, from_rpc_error
from services.gateway.http import openai_api as oa
from services.store.responses import ResponseStore

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")
MAX_METADATA_KEYS = 16
CHAT_END_WAIT_S = 1.0
"""After the turn's final frame, how long to wait for the gateway to end the Chat call itself."""
_ID = re.compile(r"^resp_[0-9a-f]{1,64}$")
_NEUTRAL: tuple[tuple[str, tuple[object, ...], str], ...] = (
    # (field, values that change nothing, why it is refused otherwise)
    ("tools", ([],), "tools are not yet supported on /v1/responses"),
    ("tool_choice", ("auto", "none"), "tools are not yet supported on /v1/responses"),
    ("background", (False,), "background responses are not supported"),
    ("conversation", (), "conversations are not supported; chain responses with previous_response_id"),
    ("prompt", (), "prompt templates are not supported"),
    ("include", ([],), "include is not supported"),
    ("top_logprobs", (0,), "logprobs are not yet supported on /v1/responses"),
    ("reasoning", ({},), "reasoning options are not supported"),
    ("truncation", ("disabled",), "only truncation 'disabled' is supported"),
    ("max_tool_calls", (), "tools are not yet supported on /v1/responses"),
)


@dataclass
class ResponsesRequest:
    """A parsed Responses request."""

    model: str
    messages: list[dict[str, str]]
    """The new input messages (role, content)."""
    instructions: str | None
    sampling: pb.SamplingParams
    stream: bool
    store: bool
    previous_response_id: str | None
    metadata: dict[str, str] = field(default_factory=dict)
    temperature: float = 1.0
    top_p: float = 1.0
    max_output_tokens: int | None = None


def _refuse(body: dict[str, Any]) -> None:
    for name, neutral, why in _NEUTRAL:
        value = body.get(name)
        if value is not None and not oa._is_neutral(value, neutral):
            raise InvalidArgument(f"'{name}': {why} by meshserve; remove it from the request")
    text = body.get("text")
    if text is not None:
        fmt = text.get("format") if isinstance(text, dict) else None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if not isinstance(text, dict) or (fmt is not None and kind != "text"):
            raise InvalidArgument(
                f"'text.format' of type {oa._show(kind)} is not yet supported on /v1/responses"
                " (only {'type': 'text'}); remove it from the request"
            )


def _content(item: dict[str, Any], where: str) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidArgument(f"'{where}.content' must be a string or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise InvalidArgument(
                f"'{where}.content[{j}]' of type {oa._show(kind)} is not supported; send text parts"
                " {'type': 'input_text', 'text': ...} (images, audio and files are not supported)"
            )
        parts.append(part["text"])
    return "".join(parts)


def _input(value: object) -> list[dict[str, str]]:
    if isinstance(value, str):
        if not value:
            raise InvalidArgument("'input' is an empty string; send some text")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidArgument("'input' must be a string or a non-empty list of messages {'role': ..., 'content': ...}")
    messages = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidArgument(f"'{where}' must be a message object {{'role': ..., 'content': ...}}")
        if item.get("type", "message") != "message":
            raise InvalidArgument(
                f"'{where}.type' is {oa._show(item.get('type'))}; only 'message' items are supported"
                " (tool calls and their outputs are not yet supported on /v1/responses)"
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
    _refuse(body)
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
    max_output = oa._int(body, "max_output_tokens", 1)
    temperature = oa._number(body, "temperature", 1.0)
    top_p = oa._number(body, "top_p", 0.0)
    sampling = pb.SamplingParams(max_tokens=max_output or 0, temperature=temperature, top_p=top_p)
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


def output_message(message_id: str, text: str | None, status: str) -> dict[str, Any]:
    """The one output item: an assistant message (no content yet while ``text`` is None)."""
    content = [] if text is None else [output_text(text)]
    return {"id": message_id, "type": "message", "status": status, "role": "assistant", "content": content}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def response_object(
    request: ResponsesRequest,
    response_id: str,
    model: str,
    created: int,
    *,
    text: str | None = None,
    final: pb.Final | None = None,
) -> dict[str, Any]:
    """The ``response`` object: in progress (no ``final``) or finished."""
    if final is None:
        status, output = "in_progress", []
    else:
        status = "incomplete" if _incomplete(final) else "completed"
        output = [output_message(_message_id(response_id), text or "", status)]
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
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": request.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": request.store,
        "temperature": request.temperature,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": request.top_p,
        "truncation": "disabled",
        "usage": _usage(final),
        "user": None,
        "metadata": request.metadata,
    }


def _message_id(response_id: str) -> str:
    return "msg_" + response_id.removeprefix("resp_")


def _header(headers: Any, name: str) -> str | None:
    for key, value in headers or ():
        if key == name:
            return str(value)
    return None


def not_found(response_id: str) -> MeshError:
    error = MeshError(
        f"no response with id {oa._show(response_id)} (never stored, expired, deleted, or another tenant's)"
    )
    error.code = "NOT_FOUND"
    return error


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
        scope = _header(await call.trailing_metadata(), md.TENANT_SCOPE)
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
            scope = _header(headers, md.TENANT_SCOPE)
            if scope is None:  # the gateway refused the call: its status says why
                await call.read()
                raise MeshError("the gateway sent no tenant for this call; retry, and report it if it persists")
            request_id = _header(headers, md.REQUEST_ID) or ""
            history: list[dict[str, str]] = []
            if parsed.previous_response_id is not None:
                assert self._store is not None
                previous = None
                if _ID.match(parsed.previous_response_id):
                    previous = await self._store.get(scope, parsed.previous_response_id)
                if previous is None:
                    raise not_found(parsed.previous_response_id)
                history = list(previous["conversation"])
            turn = pb.ChatTurn(model=parsed.model, sampling=parsed.sampling)
            if parsed.instructions:
                turn.messages.add(role="system", content=parsed.instructions)
            for message in (*history, *parsed.messages):
                turn.messages.add(role=message["role"], content=message["content"])
            await call.write(pb.ChatRequest(turn=turn))
            await call.done_writing()
            frames = _frames(call)
            first = await anext(frames, None)
            model = await self._app._served_model(parsed.model, request)
            response_id = "resp_" + request_id
            created = int(time.time())
            conversation = [*history, *parsed.messages]
            if not parsed.stream:
                text, final = await _collect(first, frames)
                body = response_object(parsed, response_id, model, created, text=text, final=final)
                await self._keep(parsed, scope, response_id, body, conversation, text)
                return web.json_response(body, headers={md.REQUEST_ID: request_id})
            events = _Events(await _sse_start(request, request_id))
            message_id = _message_id(response_id)
            item: dict[str, Any] = {"output_index": 0, "item_id": message_id}
            part = {"content_index": 0, **item}
            try:
                pending = response_object(parsed, response_id, model, created)
                await events.send("response.created", response=pending)
                await events.send("response.in_progress", response=pending)
                added = output_message(message_id, None, "in_progress")
                await events.send("response.output_item.added", output_index=0, item=added)
                await events.send("response.content_part.added", **part, part=output_text(""))
                texts: list[str] = []
                end: pb.Final | None = None
                async for delta, last in _prepend(first, frames):
                    end = last or end
                    if delta:
                        texts.append(delta)
                        await events.send("response.output_text.delta", **part, delta=delta, logprobs=[])
                if end is None:
                    raise MeshError("the stream ended without a final frame; retry, and report it if it persists")
                text = "".join(texts)
                await events.send("response.output_text.done", **part, text=text, logprobs=[])
                await events.send("response.content_part.done", **part, part=output_text(text))
                body = response_object(parsed, response_id, model, created, text=text, final=end)
                await events.send("response.output_item.done", output_index=0, item=body["output"][0])
                await self._keep(parsed, scope, response_id, body, conversation, text)
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
        conversation: list[dict[str, str]],
        text: str,
    ) -> None:
        if parsed.store and self._store is not None:
            record = {"response": body, "conversation": [*conversation, {"role": "assistant", "content": text}]}
            await self._store.put(scope, response_id, record)


Frame = tuple[str, pb.Final | None]


async def _frames(call: Any) -> AsyncIterator[Frame]:
    """(text, final) of the turn's frames; after the final frame, lets the half-closed call end before
    returning (as the chat completions route does: cancelling it at once made the gateway record some
    complete answers as CANCELLED)."""
    async for frame in call:
        final = frame.final if frame.HasField("final") else None
        yield frame.text, final
        if final is not None:
            break
    try:
        async with asyncio.timeout(CHAT_END_WAIT_S):
            async for _ in call:
                pass
    except (TimeoutError, grpc.aio.AioRpcError):
        pass  # the answer is complete: the handler's finally cancels whatever is left


async def _prepend(first: Frame | None, frames: AsyncIterator[Frame]) -> AsyncIterator[Frame]:
    if first is not None:
        yield first
        async for frame in frames:
            yield frame


async def _collect(first: Frame | None, frames: AsyncIterator[Frame]) -> tuple[str, pb.Final]:
    texts: list[str] = []
    final = None
    async for text, last in _prepend(first, frames):
        texts.append(text)
        final = last or final
    if final is None:
        raise MeshError("the stream ended without a final frame; retry, and report it if it persists")
    return "".join(texts), final


async def _sse_start(request: web.Request, request_id: str) -> web.StreamResponse:
    headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", md.REQUEST_ID: request_id}
    response = web.StreamResponse(headers=headers)
    await response.prepare(request)
    return response


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
