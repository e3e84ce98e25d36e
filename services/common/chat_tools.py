"""Tools in a chat prompt: the model's own template when it knows them, else a documented fallback.

transformers renders tools by passing ``tools=`` (a list of ``{"type": "function", "function": {...}}``)
and messages carrying ``tool_calls`` / ``tool`` roles to the chat template; :class:`Tokenizer` does
the same when the template reads a ``tools`` variable (:func:`template_knows_tools`). Many small
models' templates (SmolLM2-135M-Instruct's among them) know only ``role`` and ``content``: for those,
:func:`fallback_messages` rewrites the conversation into plain system / user / assistant messages in
the Hermes / Qwen2.5 convention, which the template then renders as any conversation:

* the tools' signatures go into the system message (appended to the caller's system message, or as
  a system message of their own), with the instruction to answer a call as
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (:data:`CALL_OPEN`,
  :data:`CALL_CLOSE`: what services/router/frontend/tool_parser.py parses out of the model's output);
* an assistant message's calls are rendered back in that same form after its content;
* consecutive ``tool`` messages become one user message of ``<tool_response>...</tool_response>``
  blocks, in order.

Messages are dicts in OpenAI's shape: ``role``, ``content`` and optionally ``name``,
``tool_call_id``, ``tool_calls`` (``[{"id", "type": "function", "function": {"name", "arguments"}}]``
with ``arguments`` JSON text).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
from jinja2 import meta

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"

_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    "</tools>\n\nFor each function call, return a json object with function name and arguments within "
    f'{CALL_OPEN}{CALL_CLOSE} XML tags:\n{CALL_OPEN}\n{{"name": <function-name>, "arguments": '
    f"<args-json-object>}}\n{CALL_CLOSE}"
)


def template_knows_tools(source: str) -> bool:
    """Whether a chat template reads the ``tools`` variable (then it renders tools its own way)."""
    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(source))
    except jinja2.exceptions.TemplateSyntaxError:
        return False


def tools_block(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system-prompt text that lists ``tools`` and says how to call them (the fallback's)."""
    lines = [_TOOLS_HEADER, *(json.dumps(t, ensure_ascii=False) for t in tools), _TOOLS_FOOTER]
    return "\n".join(lines)


def call_text(name: str, arguments: str) -> str:
    """One call as the fallback renders it (and as the model is asked to write it)."""
    try:
        args: Any = json.loads(arguments) if arguments else {}
    except ValueError:
        args = arguments  # rendered as the string the caller sent
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def _content(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""


def fallback_messages(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, str]]:
    """``messages`` (and ``tools``) as plain system / user / assistant messages (see the module docstring)."""
    out: list[dict[str, str]] = []
    for message in messages:
        role = message.get("role")
        if role == "tool":
            block = f"{RESPONSE_OPEN}\n{_content(message)}\n{RESPONSE_CLOSE}"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": "1"})
            continue
        content = _content(message)
        calls = message.get("tool_calls") or ()
        if role == "assistant" and calls:
            parts = [content] if content else []
            for call in calls:
                function = call.get("function", {})
                parts.append(call_text(str(function.get("name", "")), str(function.get("arguments", ""))))
            content = "\n".join(parts)
        out.append({"role": str(role), "content": content})
    for message in out:
        message.pop("_tool", None)
    if tools:
        block = tools_block(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def native_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` for a template that knows tools: as transformers passes them (a call's
    ``arguments`` as a dict where they are a JSON object, which tool-aware templates expect)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        item: dict[str, Any] = {"role": message.get("role"), "content": _content(message)}
        for key in ("name", "tool_call_id"):
            if message.get(key):
                item[key] = message[key]
        calls = message.get("tool_calls")
        if calls:
            item["tool_calls"] = []
            for call in calls:
                function = call.get("function", {})
                arguments: Any = function.get("arguments", "")
                try:
                    parsed = json.loads(arguments) if isinstance(arguments, str) and arguments else {}
                    arguments = parsed if isinstance(parsed, dict) else arguments
                except ValueError:
                    pass
                item["tool_calls"].append(
                    {
                        "id": call.get("id", ""),
                        "type": "function",
                        "function": {"name": function.get("name", ""), "arguments": arguments},
                    }
                )
        out.append(item)
    return out
