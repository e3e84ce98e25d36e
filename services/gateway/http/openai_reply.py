"""meshserve.v1 messages -> OpenAI JSON: whole answers, streamed chunks, usage and logprobs, the
``/v1/models`` list, and the OpenAI error body with its HTTP status. No transport here; requests are
parsed in :mod:`.openai_request`.

n choices: ``choices[i].index``, streamed chunks carry their choice's index, and usage counts the prompt
once and sums the choices' completion tokens (OpenAI's count). Tool calls come back as OpenAI's
``message.tool_calls`` and, streamed, as its ``delta.tool_calls`` (:func:`tool_call_deltas`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any, cast

from services.common.pb.meshserve.v1 import inference_pb2 as pb

OWNED_BY = "meshserve"
_FINISH = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_STOP_STRING: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_CANCELLED: "stop",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
}
# HTTP status and OpenAI error "type" per domain error code (services.common.errors.MeshError.code).
HTTP_STATUS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "CANCELLED": (499, "cancelled"),
    "INTERNAL": (500, "server_error"),
    "UNAVAILABLE": (503, "service_unavailable"),
    "DEADLINE_EXCEEDED": (504, "timeout"),
}
_ERROR_CODE = {
    "UNAUTHENTICATED": "invalid_api_key",
    "NOT_FOUND": "model_not_found",
    "RESOURCE_EXHAUSTED": "rate_limit_exceeded",
}
MIN_LOGPROB = -9999.0
"""A logprob of -inf (a token the penalties banned) is sent as this, as OpenAI does: JSON has no -inf."""


def error_body(code: str, message: str) -> tuple[int, dict[str, Any]]:
    """HTTP status and OpenAI error JSON for a domain error code."""
    status, kind = HTTP_STATUS.get(code, HTTP_STATUS["INTERNAL"])
    return status, {"error": {"message": message, "type": kind, "param": None, "code": _ERROR_CODE.get(code)}}


def retry_after_s(retry_after_ms: int) -> int:
    """Retry-After header value: whole seconds, rounded up, at least 1."""
    return max(1, math.ceil(retry_after_ms / 1000))


def tool_call_deltas(deltas: Sequence[pb.ToolCallDelta]) -> list[dict[str, Any]]:
    """A frame's tool-call deltas as OpenAI streams them: a call's first delta has its index, id,
    type and function name (with its arguments so far, often ""); later ones its index and the next
    fragment of the arguments."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        if d.id:
            function = {"name": d.name, "arguments": d.arguments}
            out.append({"index": d.index, "id": d.id, "type": "function", "function": function})
        else:
            out.append({"index": d.index, "function": {"arguments": d.arguments}})
    return out


def tool_calls(deltas: Sequence[pb.ToolCallDelta]) -> list[dict[str, Any]]:
    """All of a turn's deltas as OpenAI's ``message.tool_calls`` (whole calls, in index order)."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        call = calls.setdefault(d.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        if d.id:
            call["id"] = d.id
            call["function"]["name"] = d.name
        call["function"]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]


def finish_reason(final: pb.Final) -> str:
    return _FINISH.get(final.finish_reason, "stop")


def usage(final: pb.Final | list[pb.Final]) -> dict[str, Any]:
    """OpenAI's usage of one choice's final, or of n choices' finals: the prompt once, completions summed;
    ``completion_tokens_details.budget_closed`` when structured output was closed validly because
    ``max_tokens`` was about to run out (any choice; docs/structured_output.md)."""
    finals = final if isinstance(final, list) else [final]
    prompt = finals[0].usage.prompt_tokens if finals else 0
    completion = sum(f.usage.completion_tokens for f in finals)
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if any(f.usage.budget_closed for f in finals):
        out["completion_tokens_details"] = {"budget_closed": True}
    return out


def _logprob(value: float) -> float:
    return value if value >= MIN_LOGPROB else MIN_LOGPROB


def chat_logprobs(entries: Sequence[pb.TokenLogprob]) -> dict[str, Any]:
    """A choice's ``logprobs`` for chat (a whole answer's, or one chunk's tokens)."""
    return {
        "content": [
            {
                "token": e.token,
                "logprob": _logprob(e.logprob),
                "bytes": list(e.token_bytes),
                "top_logprobs": [
                    {"token": t.token, "logprob": _logprob(t.logprob), "bytes": list(t.token_bytes)}
                    for t in e.top_logprobs
                ],
            }
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: Sequence[pb.TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """A legacy completion's ``logprobs``: parallel lists. ``top_logprobs`` maps each alternative's text to
    its logprob, the sampled token included (OpenAI: up to logprobs + 1 entries); ``text_offset`` is each
    token's character offset in the generated text (``offset``: characters of it sent in earlier chunks)."""
    tokens: list[str] = []
    offsets: list[int] = []
    for e in entries:
        tokens.append(e.token)
        offsets.append(offset)
        offset += len(e.token)
    top: list[dict[str, float]] = []
    for e in entries:
        alternatives = {t.token: _logprob(t.logprob) for t in e.top_logprobs}
        alternatives.setdefault(e.token, _logprob(e.logprob))
        top.append(alternatives)
    return {
        "tokens": tokens,
        "token_logprobs": [_logprob(e.logprob) for e in entries],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_completion(
    request_id: str,
    model: str,
    text: str | list[str],
    final: pb.Final | list[pb.Final],
    calls: Sequence[pb.ToolCallDelta] | Sequence[Sequence[pb.ToolCallDelta]] = (),
    logprobs: Sequence[pb.TokenLogprob] | Sequence[Sequence[pb.TokenLogprob]] | None = None,
) -> dict[str, Any]:
    """A whole chat completion: one choice (``text``, ``final``, its tool-call deltas ``calls``, its
    ``logprobs`` entries), or n choices (lists by choice index, ``calls`` and ``logprobs`` then lists of
    each choice's); with tool calls, ``content`` is null when the answer had no text (as OpenAI's);
    ``logprobs`` None: the request asked for none (``"logprobs": null``)."""
    texts = text if isinstance(text, list) else [text]
    finals = final if isinstance(final, list) else [final]
    per_choice = cast(list[Sequence[pb.ToolCallDelta]], list(calls) if isinstance(text, list) else [calls])
    per_choice += [()] * (len(texts) - len(per_choice))
    entries: list[Sequence[pb.TokenLogprob] | None] = [None] * len(texts)
    if logprobs is not None:
        entries = cast(list[Sequence[pb.TokenLogprob] | None], list(logprobs) if isinstance(text, list) else [logprobs])

    def message(i: int, t: str) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": t}
        if per_choice[i]:
            out["content"] = t or None
            out["tool_calls"] = tool_calls(per_choice[i])
        return out

    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": i,
                "message": message(i, t),
                "logprobs": None if entries[i] is None else chat_logprobs(entries[i] or ()),
                "finish_reason": finish_reason(f),
            }
            for i, (t, f) in enumerate(zip(texts, finals, strict=True))
        ],
        "usage": usage(finals),
    }


def chat_chunk(
    request_id: str,
    model: str,
    delta: dict[str, Any],
    finish: str | None = None,
    created: int = 0,
    include_usage: bool = False,
    index: int = 0,
    logprobs: Sequence[pb.TokenLogprob] | None = None,
) -> dict[str, Any]:
    """One streamed chunk of choice ``index``; with ``include_usage`` it has ``"usage": null``, as OpenAI's
    chunks before the last. ``logprobs``: the chunk's tokens' (None: ``"logprobs": null``)."""
    chunk: dict[str, Any] = {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "delta": delta,
                "logprobs": None if logprobs is None else chat_logprobs(logprobs),
                "finish_reason": finish,
            }
        ],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def completion(
    request_id: str,
    model: str,
    text: str,
    final: pb.Final | None,
    created: int = 0,
    with_usage: bool = True,
    null_usage: bool = False,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """A whole completion, or (``final`` None / ``with_usage`` False) one streamed chunk of one, of choice
    ``index``.

    ``null_usage``: a chunk of a stream with ``include_usage`` carries ``"usage": null`` (the last
    chunk, from :func:`usage_chunk`, carries the counts). ``logprobs``: :func:`completion_logprobs`.
    """
    body: dict[str, Any] = {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": created or int(time.time()),
        "model": model,
        "choices": [
            {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason(final) if final else None,
            }
        ],
    }
    if final is not None and with_usage:
        body["usage"] = usage(final)
    elif null_usage:
        body["usage"] = None
    return body


def completions(
    request_id: str,
    model: str,
    texts: list[str],
    finals: list[pb.Final],
    logprobs: Sequence[Sequence[pb.TokenLogprob]] | None = None,
) -> dict[str, Any]:
    """A whole completion of n choices (by choice index); usage as :func:`usage` counts n finals;
    ``logprobs``: each choice's entries (None: the request asked for none)."""
    body = completion(request_id, model, "", None)
    body["choices"] = [
        {
            "index": i,
            "text": t,
            "logprobs": None if logprobs is None else completion_logprobs(logprobs[i]),
            "finish_reason": finish_reason(f),
        }
        for i, (t, f) in enumerate(zip(texts, finals, strict=True))
    ]
    body["usage"] = usage(finals)
    return body


def usage_chunk(
    object_name: str, request_id: str, model: str, final: pb.Final | list[pb.Final], created: int
) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage (of
    every choice's final: the prompt once, completions summed)."""
    prefix = "chatcmpl" if object_name == "chat.completion.chunk" else "cmpl"
    return {
        "id": f"{prefix}-{request_id}",
        "object": object_name,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(final),
    }


def models_list(reply: pb.ListModelsResponse) -> dict[str, Any]:
    return {"object": "list", "data": [model_entry(m.id, m) for m in reply.models]}


def generation_defaults(d: pb.GenerationDefaults) -> dict[str, Any]:
    """A model's generation defaults as JSON: only the fields it has a default for (float32 on the wire,
    so rounded to 6 digits: 0.2, not 0.20000000298)."""
    out: dict[str, Any] = {}
    for name in ("temperature", "top_p", "repetition_penalty"):
        if d.HasField(name):  # type: ignore[arg-type]
            out[name] = round(float(getattr(d, name)), 6)
    if d.HasField("top_k"):
        out["top_k"] = d.top_k
    if d.max_tokens:
        out["max_tokens"] = d.max_tokens
    if d.stop:
        out["stop"] = list(d.stop)
    return out


def model_entry(model_id: str, info: pb.ModelInfo | None = None) -> dict[str, Any]:
    """One ``/v1/models`` entry: OpenAI's fields, and (when the router listed it) the model's
    ``generation_defaults`` (what a request that leaves those fields unset gets) and ``state``
    (``awake``, ``waking``, ``asleep`` or ``stopped``: a sleeping model wakes on its first request)."""
    entry: dict[str, Any] = {"id": model_id, "object": "model", "created": 0, "owned_by": OWNED_BY}
    if info is not None:
        entry["generation_defaults"] = generation_defaults(info.generation_defaults)
        if info.state:
            entry["state"] = info.state
    return entry
