"""The model's output of a turn with tools, as content and tool calls, incrementally while it streams.

Our own code: the calls follow this server's prompt format (services/common/chat_tools.py) and the
constraint of services/router/tools.py, and their deltas must come out as OpenAI streams them, which
no library here does. Two forms are recognised:

* call blocks anywhere in the text: ``<tool_call>`` + a call object + ``</tool_call>`` (the prompt's
  format, and the ``auto`` constraint's);
* with ``required`` or a named function, a bare call object or a JSON array of them as the whole
  output (the JSON-schema constraint of those choices).

A call object is ``{"name": "...", "arguments": {...}}`` (``"parameters"`` is read as
``"arguments"``). With its name first, the call's first delta (index, a new ``call_`` id, the name,
empty arguments) goes out as soon as the name is complete and is a tool of the turn; then the
arguments' JSON text streams in fragments as it arrives. Other key orders are parsed when the block
closes (one delta with the whole arguments). A block that does not parse, or names no tool of the
turn, is content, as the model wrote it. Text that may be the start of ``<tool_call>`` is held back
until it is known not to be; whitespace between and after calls is dropped. With parallel calls off,
everything after the first call is dropped.

An output cut short inside a call (``max_tokens``: the turn ends with ``finish_reason`` ``length``) ends
that call as OpenAI does, never as content: a call whose arguments had begun keeps what was streamed; a
call whose name is complete (and a tool of the turn) but whose arguments had not begun is sent with
empty arguments; one cut inside its name (a prefix of a tool's name) is dropped.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable, Iterable
from enum import Enum, auto
from typing import Any

from services.common.chat_tools import CALL_CLOSE, CALL_OPEN
from services.router.tools import ToolCallDelta

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_NAMED = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
"""A call object whose name is complete (what follows it may be cut)."""
_NAMING = re.compile(r'\s*\{\s*(?:"(?:n(?:a(?:m(?:e(?:"\s*(?::\s*(?:"([^"\\]*))?)?)?)?)?)?)?)?')
"""A beginning of a call object cut before its name was complete (group 1: the name so far)."""
_ID_CHARS = string.ascii_letters + string.digits


def new_call_id() -> str:
    """An id as OpenAI's: ``call_`` and 24 letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


class _State(Enum):
    TEXT = auto()
    HEAD = auto()  # in a call object, before its arguments
    ARGS = auto()  # streaming the arguments value
    TAIL = auto()  # after the arguments, to the end of the call object
    CLOSE = auto()  # after the call object, to </tool_call> (blocks) or the next element (bare array)
    RAW = auto()  # a block that is content after all: to its </tool_call>
    DROP = auto()  # the rest of the output is dropped


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a beginning of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """Feed it the output's text as it comes (:meth:`feed`), then :meth:`finish`; each returns the
    content text and the tool-call deltas to pass on."""

    def __init__(
        self,
        names: Iterable[str],
        *,
        parallel: bool = True,
        bare_json: bool = False,
        new_id: Callable[[], str] = new_call_id,
    ) -> None:
        self._names = frozenset(names)
        self._parallel = parallel
        self._bare = bare_json  # the output may be bare call JSON (required / named function)
        self._new_id = new_id
        self._state = _State.TEXT
        self._buf = ""  # text not yet consumed
        self._raw = ""  # the current call's text as written (content, should it not parse)
        self._in_block = False  # the current call is a <tool_call> block (else bare JSON)
        self._array = False  # bare JSON: an array of calls
        self._started = False  # anything but whitespace seen
        self._ws = ""  # whitespace held until content follows
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._arguments_begun = False
        self._text_since_call = False
        self.calls = 0
        """Calls started so far."""

    # -- the output, piece by piece ----------------------------------------------------------------

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """The content and deltas that ``text`` (the next piece of output) completes."""
        self._buf += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while self._step(content, deltas):
            pass
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The end of the output: whatever was held back, as content or a last call."""
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        if self._state is _State.TEXT:
            if self._buf.strip():
                self._content(self._buf, content)
        elif self._state is _State.HEAD:
            # A call cut short by the end (or a block never closed): whole, cut, or content as written.
            if not self._whole_calls(self._buf, deltas) and not self._cut_call(self._buf, deltas):
                self._content(self._raw + self._buf, content)
        elif self._state is _State.RAW:
            self._content(self._raw + self._buf, content)
        elif self._state in (_State.ARGS, _State.TAIL):
            self.calls += 1  # its first delta went out: a call, cut short
        self._buf = ""
        self._state = _State.DROP
        return "".join(content), deltas

    # -- states ------------------------------------------------------------------------------------

    def _content(self, text: str, out: list[str]) -> None:
        if not text:
            return
        if not text.strip():
            self._ws += text
            return
        if self.calls:  # content after a call: whitespace around calls stays dropped
            out.append(text if self._text_since_call else text.lstrip())
            self._text_since_call = True
        else:
            out.append(self._ws + text)
        self._ws = ""
        self._started = True

    def _step(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        """One transition; False when it needs more text."""
        state = self._state
        if state is _State.DROP:
            self._buf = ""
            return False
        if state is _State.TEXT:
            return self._text(content)
        if state is _State.HEAD:
            return self._head(content, deltas)
        if state is _State.ARGS:
            return self._args(deltas)
        if state is _State.TAIL:
            return self._tail()
        if state is _State.CLOSE:
            return self._close()
        return self._raw_block(content)

    def _text(self, content: list[str]) -> bool:
        buf = self._buf
        if self._bare and not self._started and not self.calls:
            stripped = buf.lstrip()
            if not stripped:
                return False
            if stripped[0] in "{[":
                self._array = stripped[0] == "["
                self._buf = stripped[1:] if self._array else stripped
                self._in_block = False
                self._raw = buf[: len(buf) - len(self._buf)]
                self._state = _State.HEAD
                return True
        at = buf.find(CALL_OPEN)
        if at >= 0:
            self._content(buf[:at], content)
            self._buf = buf[at + len(CALL_OPEN) :]
            self._raw = CALL_OPEN
            self._in_block = True
            self._state = _State.HEAD
            return True
        keep = _partial_suffix(buf, CALL_OPEN)
        self._content(buf[: len(buf) - keep], content)
        self._buf = buf[len(buf) - keep :]
        return False

    def _head(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        match = _HEAD.match(self._buf)
        if match is None:
            if self._in_block and (end := self._buf.find(CALL_CLOSE)) >= 0:
                body = self._buf[:end]
                self._buf = self._buf[end + len(CALL_CLOSE) :]
                if not self._whole_calls(body, deltas):
                    self._content(self._raw + body + CALL_CLOSE, content)
                self._after_call()
                return True
            return False  # a head in another key order is parsed whole, at the close or the end
        try:
            name = json.loads(f'"{match.group(1)}"')
        except ValueError:
            name = None
        if name not in self._names:
            self._state = _State.RAW
            return True
        self._raw += self._buf[: match.end()]
        self._buf = self._buf[match.end() :]
        deltas.append(ToolCallDelta(self.calls, self._new_id(), name, ""))
        self._depth = 0
        self._in_string = self._escape = self._arguments_begun = False
        self._state = _State.ARGS
        return True

    def _args(self, deltas: list[ToolCallDelta]) -> bool:
        """Stream the arguments value; it ends where its brackets close (or, a scalar, at , or })."""
        buf = self._buf
        if not self._arguments_begun:
            buf = buf.lstrip()
            if not buf:
                self._buf = ""
                return False
            self._arguments_begun = True
        end = None
        for i, ch in enumerate(buf):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                    if self._depth == 0:
                        end = i + 1
                        break
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                if self._depth == 0:  # a scalar's end: the call object's own close
                    end = i
                    break
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
                    break
            elif ch == "," and self._depth == 0:
                end = i
                break
        piece = buf if end is None else buf[:end]
        if piece:
            self._append_arguments(piece, deltas)
        self._buf = "" if end is None else buf[end:]
        if end is None:
            return False
        self._depth = 0
        self._state = _State.TAIL
        return True

    def _append_arguments(self, piece: str, deltas: list[ToolCallDelta]) -> None:
        index = self.calls
        if deltas and deltas[-1].index == index:  # one delta per call per piece of output
            last = deltas.pop()
            deltas.append(ToolCallDelta(index, last.id, last.name, last.arguments + piece))
        else:
            deltas.append(ToolCallDelta(index, arguments=piece))

    def _tail(self) -> bool:
        """Skip to the end of the call object (other keys, if any, are ignored)."""
        for i, ch in enumerate(self._buf):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                if self._depth == 0:
                    self._buf = self._buf[i + 1 :]
                    self._state = _State.CLOSE
                    self.calls += 1
                    return True
                self._depth -= 1
        self._buf = ""
        return False

    def _close(self) -> bool:
        if self._in_block:
            end = self._buf.find(CALL_CLOSE)
            if end < 0:
                keep = _partial_suffix(self._buf, CALL_CLOSE)
                self._buf = self._buf[len(self._buf) - keep :]
                return False
            self._buf = self._buf[end + len(CALL_CLOSE) :]
            self._after_call()
            return True
        stripped = self._buf.lstrip()
        if not stripped:
            self._buf = ""
            return False
        if self._array and stripped[0] == "," and self._parallel:
            self._buf = stripped[1:]
            self._raw = ""
            self._state = _State.HEAD
            return True
        self._state = _State.DROP  # the bare JSON has ended (or parallel calls are off)
        return True

    def _raw_block(self, content: list[str]) -> bool:
        if self._in_block and (end := self._buf.find(CALL_CLOSE)) >= 0:
            self._content(self._raw + self._buf[: end + len(CALL_CLOSE)], content)
            self._buf = self._buf[end + len(CALL_CLOSE) :]
            self._raw = ""
            self._state = _State.TEXT
            return True
        return False  # bare JSON that is no call: content, at the end

    def _after_call(self) -> None:
        self._raw = ""
        self._text_since_call = False
        self._state = _State.TEXT if self._parallel or not self.calls else _State.DROP

    def _cut_call(self, text: str, deltas: list[ToolCallDelta]) -> bool:
        """``text`` (the output's end, in a call's head) is a call the end cut short: sent with empty
        arguments when its name is complete and a tool's, dropped when the end fell inside a tool's
        name; False when it is not the beginning of a call (content, as written)."""
        if not text.strip():  # cut right after a block's tag or an array's bracket
            return self._in_block or self._array
        named = _NAMED.match(text)
        if named is not None:
            try:
                name = json.loads(f'"{named.group(1)}"')
            except ValueError:
                return False
            if name not in self._names:
                return False
            deltas.append(ToolCallDelta(self.calls, self._new_id(), name, ""))
            self.calls += 1
            return True
        naming = _NAMING.fullmatch(text.rstrip())
        if naming is None:
            return False
        partial = naming.group(1) or ""
        return any(name.startswith(partial) for name in self._names)

    def _whole_calls(self, body: str, deltas: list[ToolCallDelta]) -> bool:
        """``body`` (a block's, or the bare output) parsed whole: its calls as one delta each."""
        text = body.strip()
        if not self._in_block and self._array:
            text = "[" + text  # the rest of a bare array, after the calls already sent
        try:
            value: Any = json.loads(text)
        except ValueError:
            return False
        items = value if isinstance(value, list) else [value]
        calls = []
        for item in items:
            if not isinstance(item, dict) or item.get("name") not in self._names:
                return False
            arguments = item.get("arguments", item.get("parameters", {}))
            calls.append((item["name"], json.dumps(arguments, ensure_ascii=False)))
        if not calls:
            return False
        for name, arguments in calls if self._parallel else calls[:1]:
            deltas.append(ToolCallDelta(self.calls, self._new_id(), name, arguments))
            self.calls += 1
        return True
