"""One batch line: its body as the request the HTTP API would have sent, and its output line.

The body goes through the very parsing of the OpenAI adapter (:mod:`services.gateway.http.openai_request`)
and the gateway's checks (:mod:`services.gateway.validation`), so a line is accepted or refused
exactly as the same request sent to ``/v1/chat/completions`` or ``/v1/completions`` would be.
A line always runs at priority 0, the lowest class. Output lines are OpenAI's:
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``.
"""

from __future__ import annotations

import json
from typing import Any

from services.common.errors import InvalidArgument
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.gateway.http import openai_reply, openai_request
from services.gateway.validation import Limits, validate_chat_request, validate_generate

BATCH_PRIORITY = 0
"""The routing priority of every batch line: the lowest class (services/router/balancer/fairness.py)."""
CHAT = "/v1/chat/completions"


def request_for(url: str, body: dict[str, Any], limits: Limits) -> pb.ChatRequest | pb.GenerateRequest:
    """The checked request of a line's ``body`` (raises :class:`InvalidArgument` like the HTTP API)."""
    if body.get("stream"):
        raise InvalidArgument("'stream' must be false in a batch: a batch writes whole responses")
    field = openai_request.invalid_unicode_field(body)
    if field is not None:
        raise InvalidArgument(f"{field} is not valid Unicode; send valid UTF-8 text")
    if url == CHAT:
        _, chat = openai_request.chat_request(body)
        chat.turn.routing.priority = BATCH_PRIORITY
        chat.turn.routing.background = True
        validate_chat_request(chat, limits)
        return chat
    _, generate = openai_request.completion_request(body)
    generate.routing.priority = BATCH_PRIORITY
    generate.routing.background = True
    validate_generate(generate, limits)
    return generate


def line_id(batch_id: str, index: int) -> str:
    """The output line's id, the same however often the line runs."""
    return f"batch_req_{batch_id.removeprefix('batch_')}_{index}"


def success(batch_id: str, index: int, custom_id: str, request_id: str, body: dict[str, Any]) -> str:
    response = {"status_code": 200, "request_id": request_id, "body": body}
    return _line(batch_id, index, custom_id, response, None)


def failure(batch_id: str, index: int, custom_id: str, request_id: str, code: str, message: str) -> str:
    """An error-file line: the HTTP status and OpenAI error body the same request would have got."""
    status, error_body = openai_reply.error_body(code, message)
    response = {"status_code": status, "request_id": request_id, "body": error_body}
    return _line(batch_id, index, custom_id, response, {"code": error_body["error"]["type"], "message": message})


def expired_template() -> str:
    """The error line of a request left unfinished when its batch expired (``{id}``/``{custom_id}`` placeholders)."""
    error = {"code": "batch_expired", "message": "this request was not run before the batch's completion window ended"}
    return json.dumps({"id": "{id}", "custom_id": "{custom_id}", "response": None, "error": error})


def _line(batch_id: str, index: int, custom_id: str, response: Any, error: Any) -> str:
    out = {"id": line_id(batch_id, index), "custom_id": custom_id, "response": response, "error": error}
    return json.dumps(out, separators=(",", ":"), ensure_ascii=False)
