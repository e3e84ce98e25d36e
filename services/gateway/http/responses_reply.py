"""meshserve.v1 frames -> OpenAI Responses JSON (``POST /v1/responses``): the ``response`` object, its
output items, and the streamed Responses events. Requests are parsed in :mod:`.responses_request`, the
routes are :mod:`.responses` (the three were one module, responses.py, until this split).

The answer is a ``response`` object whose output is a ``message`` item for the answer's text and one
``function_call`` item per tool call, in the order the model produced them; or (``stream``) the
Responses events in OpenAI's order: ``response.created``, ``response.in_progress``, then per item
``response.output_item.added``, for a message ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``, ``response.content_part.done``, for a
function call ``response.function_call_arguments.delta``..., ``response.function_call_arguments.done``,
then ``response.output_item.done``; last ``response.completed`` (or ``response.incomplete`` when
``max_output_tokens`` cut it short). An error after the stream started is an ``error`` event (the route
sends it).
:class:`Events` numbers the events and writes them to the server-sent-event response the route opened.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from aiohttp import web

from services.common.errors import MeshError
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.gateway.http import openai_reply, responses_request, streams


def _usage(final: pb.Final | None) -> dict[str, Any] | None:
    if final is None:
        return None
    u = final.usage
    details: dict[str, Any] = {"reasoning_tokens": 0}
    if u.budget_closed:  # structured output closed validly before max_output_tokens ran out
        details["budget_closed"] = True
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": details,
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
    request: responses_request.ResponsesRequest,
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


class Output:
    """The output items of one answer, built from its frames in the order the model produced them: a
    ``message`` item for a run of text, a ``function_call`` item per tool call. With ``events`` each step
    is also streamed as OpenAI streams it."""

    def __init__(self, response_id: str, events: Events | None, with_logprobs: bool) -> None:
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
                responses_request.append_function_call(item, "output", messages)
        return messages


def _message_id(response_id: str) -> str:
    return "msg_" + response_id.removeprefix("resp_")


async def answer(first: streams.Frame | None, frames: AsyncIterator[streams.Frame], out: Output) -> pb.Final:
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


class Events:
    """The SSE events of one streamed response, numbered (``sequence_number``) as OpenAI numbers them."""

    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response
        self._sequence = 0

    async def send(self, kind: str, **payload: Any) -> None:
        data = {"type": kind, "sequence_number": self._sequence, **payload}
        self._sequence += 1
        line = json.dumps(data, separators=(",", ":"))
        await self.response.write(f"event: {kind}\ndata: {line}\n\n".encode())
