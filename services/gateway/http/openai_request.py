"""OpenAI request JSON -> meshserve.v1 messages (``/v1/chat/completions``, ``/v1/completions``). No
transport here; the answers' JSON is built in :mod:`.openai_reply`.

The OpenAI shapes differ from our proto (messages vs turns, ``choices``, ``stop`` as string or list),
which is why Envoy's gRPC-JSON transcoder cannot speak them on its own; this module and
:mod:`.openai_reply` are the whole difference.
``n`` (1 to 16) asks for that many choices. Unsupported fields that change the answer (``logprobs``,
``echo``, the legacy ``functions``, ``min_p``, audio) are refused with 400 rather than silently
ignored, unless they hold their neutral value (``logprobs: false``, ...: clients send defaults).
``tools``, ``tool_choice`` and ``parallel_tool_calls``, assistant ``tool_calls`` and ``tool`` messages
map to the ChatTurn's tool fields (their limits are the router's: services/router/tools.py).
Fields that only tune delivery or bookkeeping (``user``, ``metadata``, ``store``, ...) and unknown fields
are accepted and ignored, as many OpenAI-compatible servers do (new OpenAI fields keep working). ``frequency_penalty``,
``presence_penalty`` and ``logit_bias`` are OpenAI's; ``top_k``, ``repetition_penalty`` and
``min_tokens`` are vLLM's extensions, honoured as vLLM takes them in the body. Their ranges are
checked once, by the gateway (services/common/sampling.py); here only their JSON types.
``response_format`` (``text``, ``json_object``, ``json_schema``; chat and completions, as vLLM) becomes
``SamplingParams.structured`` after the cheap checks of services/common/constraints.py, here, so a
bad schema is a 400 that names ``response_format``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

from services.common.constraints import Constraint, check_constraint, json_schema_constraint
from services.common.errors import InvalidArgument
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.sampling import MAX_CHOICES, MAX_SEED, MAX_TOP_LOGPROBS
from services.common.sampling_pb import structured_to_pb

UINT32_MAX = 2**32 - 1
MAX_COMPLETION_LOGPROBS = 5
"""Largest ``logprobs`` of a legacy completion (OpenAI's limit; chat's ``top_logprobs`` goes to 20)."""
_UNSUPPORTED: tuple[tuple[str, tuple[object, ...], str], ...] = (
    # (field, values that change nothing, why it is refused otherwise)
    ("echo", (False,), "echo is not supported"),
    ("functions", ([],), "the legacy 'functions' are not supported (send 'tools')"),
    ("function_call", ("none", "auto"), "the legacy 'function_call' is not supported (send 'tool_choice')"),
    ("suffix", ("",), "suffix is not supported"),
    ("best_of", (1,), "best_of is not supported"),
    ("min_p", (0,), "min_p is not supported"),
    ("modalities", (["text"],), "only text output is supported"),
    ("audio", (), "audio output is not supported"),
    ("web_search_options", (), "web search is not supported"),
)
_SURROGATE = re.compile("[\ud800-\udfff]")


def invalid_unicode_field(body: object, path: str = "") -> str | None:
    """Where the first string in a parsed JSON body, key or value, is not valid Unicode, for an error
    message (``'messages[0].content'``, ``a key in 'messages[0]'``), else None.

    Strict UTF-8 decoding lets no surrogate code point through, but a JSON escape can: ``"\\ud800"``
    is valid JSON naming a lone surrogate (so is a reversed pair, low before high), which no UTF-8
    encoder accepts, and protobuf, gRPC and the tokenizer would each fail on it much later.
    """
    if isinstance(body, str):
        return (repr(path) if path else "the request body") if _SURROGATE.search(body) else None
    if isinstance(body, dict):
        for key, value in body.items():
            name = f"{path}.{key}" if path else str(key)
            if _SURROGATE.search(key):
                return f"a key in {path!r}" if path else "a key of the request body"
            found = invalid_unicode_field(value, name)
            if found is not None:
                return found
    elif isinstance(body, list):
        for i, value in enumerate(body):
            found = invalid_unicode_field(value, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _show(value: object) -> str:
    """A request value for an error message, cut short (a 4 MiB string must not come back whole)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True)
class Parsed:
    """A parsed OpenAI request: the model it named, whether to stream, and usage-in-stream."""

    model: str
    stream: bool
    include_usage: bool
    tools: bool = False
    """The request has tools its answer may call (``tool_choice`` other than ``none``)."""
    n: int = 1
    """Choices asked for."""


def _number(body: dict[str, Any], name: str, default: float = 0.0) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"'{name}' must be a number (got {_show(value)})")
    return float(value)


def _int(body: dict[str, Any], name: str, low: int = 0, high: int = UINT32_MAX) -> int | None:
    """An optional integer field in ``[low, high]`` (None when absent); anything else is a clear 400."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"'{name}' must be an integer (got {_show(value)})")
    if not low <= value <= high:
        raise InvalidArgument(f"'{name}' must be between {low} and {high} (got {_show(value)})")
    return value


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise InvalidArgument("'stop' must be a string or a list of strings")


def _is_neutral(value: object, neutral: tuple[object, ...]) -> bool:
    """``value`` is one of ``neutral`` (``true`` is not ``1``, though Python says ``True == 1``)."""
    return any(value is n or (not isinstance(value, bool) and value == n) for n in neutral)


def _refuse_unsupported(
    body: dict[str, Any], fields: tuple[tuple[str, tuple[object, ...], str], ...] = _UNSUPPORTED
) -> None:
    """400 for the first of ``fields`` (name, values that change nothing, why) the body sets otherwise."""
    for name, neutral, why in fields:
        value = body.get(name)
        if value is not None and not _is_neutral(value, neutral):
            raise InvalidArgument(f"'{name}': {why} by meshserve; remove it from the request")


def _common(body: dict[str, Any]) -> tuple[Parsed, pb.SamplingParams]:
    _refuse_unsupported(body)
    model = body.get("model", "")
    if not isinstance(model, str):
        raise InvalidArgument("'model' must be a string; GET /v1/models lists the served models")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidArgument("'stream' must be true or false")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidArgument("'stream_options' must be an object such as {'include_usage': true}")
    include_usage = bool(options and options.get("include_usage"))
    # max_completion_tokens replaces max_tokens in newer clients; it wins when both are sent.
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    # Omitted fields stay unset: the served model's generation defaults fill them (docs/router.md).
    sampling = pb.SamplingParams(max_tokens=max_tokens or 0, stop=_stop(body))
    if body.get("temperature") is not None:
        sampling.temperature = _number(body, "temperature")
    if body.get("top_p") is not None:
        sampling.top_p = _number(body, "top_p")
    top_k = _int(body, "top_k", -1)  # vLLM's extension; -1 (vLLM's "off") and 0 both disable it
    if top_k is not None:
        sampling.top_k = max(top_k, 0)
    # OpenAI's seed is an int64; ours a uint64: a negative seed maps to its two's complement.
    seed = _int(body, "seed", -(2**63), MAX_SEED)
    if seed is not None:
        sampling.seed = seed % (MAX_SEED + 1)
    sampling.frequency_penalty = _number(body, "frequency_penalty")
    sampling.presence_penalty = _number(body, "presence_penalty")
    if body.get("repetition_penalty") is not None:  # absent: the model's default
        sampling.repetition_penalty = _number(body, "repetition_penalty")
    sampling.min_tokens = _int(body, "min_tokens") or 0
    for token, bias in _logit_bias(body).items():
        sampling.logit_bias[token] = bias
    structured = _response_format(body)
    if structured is not None:
        sampling.structured.CopyFrom(structured_to_pb(structured))
    n = _int(body, "n", 1, MAX_CHOICES)
    if n is not None:
        sampling.n = n
    return Parsed(model, stream, include_usage, n=n or 1), sampling


def _response_format(body: dict[str, Any]) -> Constraint | None:
    """OpenAI's ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``, or
    ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``. The output
    is held to the schema whatever ``strict`` says (a constrained decoder cannot do less)."""
    value = body.get("response_format")
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidArgument("'response_format' must be an object such as {'type': 'json_object'}")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return check_constraint("json_object", field="response_format")
    if kind != "json_schema":
        raise InvalidArgument(
            f"'response_format' type {_show(kind)} is not supported; use 'text', 'json_object' or 'json_schema'"
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidArgument(
            "'response_format.json_schema' must be an object such as {'name': 'answer', 'schema': {...}}"
        )
    name = spec.get("name", "")
    if not isinstance(name, str) or len(name) > 64:
        raise InvalidArgument("'response_format.json_schema.name' must be a string of at most 64 characters")
    if not isinstance(spec.get("strict", False), bool | None):
        raise InvalidArgument("'response_format.json_schema.strict' must be true or false")
    schema = spec.get("schema")
    if schema is None:
        raise InvalidArgument("'response_format.json_schema.schema' is missing; send the JSON Schema object")
    return json_schema_constraint(schema, field="response_format.json_schema.schema")


def _logit_bias(body: dict[str, Any]) -> dict[int, float]:
    """OpenAI's ``logit_bias``: an object from token ids (JSON keys, so strings) to numbers."""
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidArgument("'logit_bias' must be an object mapping token ids to biases, e.g. {\"50256\": -100}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidArgument(f"'logit_bias' key {_show(key)} is not a token id; use integer token ids") from None
        if not 0 <= token <= UINT32_MAX:
            raise InvalidArgument(f"'logit_bias' key {_show(key)} is not a token id; token ids are 0 or more")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise InvalidArgument(f"'logit_bias' value for token {token} must be a number (got {_show(bias)})")
        out[token] = float(bias)
    return out


def _content(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else None
                raise InvalidArgument(
                    f"message content part of type {_show(kind)} is not supported; send text parts"
                    " {'type': 'text', 'text': ...} (images, audio and files are not supported)"
                )
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise InvalidArgument("message 'content' must be a string or a list of text parts")


def _string(value: object, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidArgument(f"'{where}' must be a string (got {_show(value)})")
    return value


def _tools(body: dict[str, Any], turn: pb.ChatTurn) -> None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` into the turn (JSON types only here)."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise InvalidArgument("'tools' must be a list of {'type': 'function', 'function': {...}}")
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
            if not isinstance(function, dict):
                raise InvalidArgument(
                    f"'tools[{i}]' must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}};"
                    " only function tools are supported"
                )
            parameters = function.get("parameters")
            if parameters is not None and not isinstance(parameters, dict):
                raise InvalidArgument(f"'tools[{i}].function.parameters' must be a JSON Schema object")
            turn.tools.add(
                name=_string(function.get("name"), f"tools[{i}].function.name"),
                description=_string(function.get("description"), f"tools[{i}].function.description"),
                parameters_json=_schema_text(parameters, i) if parameters is not None else "",
            )
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidArgument("'parallel_tool_calls' must be true or false")
    if choice is None and parallel is None:
        return
    turn.tool_choice.SetInParent()
    if parallel is not None:
        turn.tool_choice.parallel_tool_calls = parallel
    if choice is None:
        return
    if isinstance(choice, str) and choice in _TOOL_CHOICE:
        turn.tool_choice.mode = _TOOL_CHOICE[choice]
        return
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidArgument(
            "'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}"
        )
    turn.tool_choice.mode = pb.TOOL_CHOICE_FUNCTION
    turn.tool_choice.function_name = function["name"]


def _schema_text(parameters: dict[str, Any], i: int) -> str:
    try:
        return json.dumps(parameters, ensure_ascii=False)
    except (RecursionError, ValueError):
        raise InvalidArgument(f"'tools[{i}].function.parameters' is nested too deeply; flatten the schema") from None


_TOOL_CHOICE = {"auto": pb.TOOL_CHOICE_AUTO, "none": pb.TOOL_CHOICE_NONE, "required": pb.TOOL_CHOICE_REQUIRED}


def _message(message: dict[str, Any], i: int, turn: pb.ChatTurn) -> None:
    role = "system" if message["role"] == "developer" else message["role"]
    msg = turn.messages.add(role=role, content=_content(message))
    msg.name = _string(message.get("name"), f"messages[{i}].name")
    msg.tool_call_id = _string(message.get("tool_call_id"), f"messages[{i}].tool_call_id")
    calls = message.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, list):
        raise InvalidArgument(f"'messages[{i}].tool_calls' must be a list of tool calls")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise InvalidArgument(
                f"'messages[{i}].tool_calls[{j}]' must be {{'id': ..., 'type': 'function', 'function': "
                "{'name': ..., 'arguments': ...}}"
            )
        msg.tool_calls.add(
            id=_string(call.get("id"), f"messages[{i}].tool_calls[{j}].id"),
            name=_string(function.get("name"), f"messages[{i}].tool_calls[{j}].function.name"),
            arguments=_string(function.get("arguments"), f"messages[{i}].tool_calls[{j}].function.arguments"),
        )


def _chat_logprobs(body: dict[str, Any], sampling: pb.SamplingParams) -> None:
    """Chat's ``logprobs`` (true/false) and ``top_logprobs`` (0 to 20, needs ``logprobs``: OpenAI's rule)."""
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise InvalidArgument(f"'logprobs' must be true or false (got {_show(wanted)})")
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    if top and not wanted:
        raise InvalidArgument(
            "'top_logprobs' needs 'logprobs' set to true; add \"logprobs\": true or drop top_logprobs"
        )
    sampling.logprobs = bool(wanted)
    sampling.top_logprobs = top


def _completion_logprobs(body: dict[str, Any], sampling: pb.SamplingParams) -> None:
    """A legacy completion's ``logprobs``: how many alternatives per token, 0 to 5 (null: off)."""
    if body.get("top_logprobs") not in (None, 0):
        raise InvalidArgument(
            "'top_logprobs' is a chat completions field; a completion takes an integer 'logprobs' (0 to 5)"
        )
    top = _int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    if top is not None:
        sampling.logprobs = True
        sampling.top_logprobs = top


def chat_request(body: dict[str, Any]) -> tuple[Parsed, pb.ChatRequest]:
    """An OpenAI chat completion request as the one turn of a Chat stream."""
    parsed, sampling = _common(body)
    _chat_logprobs(body, sampling)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("'messages' must be a non-empty list of {'role': ..., 'content': ...}")
    turn = pb.ChatTurn(model=parsed.model, sampling=sampling)
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidArgument("each message must be an object with a 'role' and a 'content'")
        _message(message, i, turn)
    _tools(body, turn)
    callable_tools = bool(turn.tools) and turn.tool_choice.mode != pb.TOOL_CHOICE_NONE
    return replace(parsed, tools=callable_tools), pb.ChatRequest(turn=turn)


def completion_request(body: dict[str, Any]) -> tuple[Parsed, pb.GenerateRequest]:
    """An OpenAI (legacy) completion request as a GenerateRequest."""
    parsed, sampling = _common(body)
    _completion_logprobs(body, sampling)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InvalidArgument("'prompt' must be a string (one prompt per request)")
    return parsed, pb.GenerateRequest(model=parsed.model, prompt=prompt, sampling=sampling)
