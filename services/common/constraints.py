"""Structured output: the constraint type, its cheap checks, and every limit once.

A request may constrain its generated text to a language: any JSON object (OpenAI's
``response_format: {"type": "json_object"}``), JSON valid against a schema (``json_schema``), a
regular expression, or a Lark grammar (llguidance's dialect: docs/structured_output.md). The
constraint rides in :class:`services.common.sampling.SamplingParams` (``structured``), so it reaches
the workers, the response cache key and request collapsing with the other sampling fields.

:func:`check_constraint` runs where a request arrives (the gateway, the router, the worker): size,
JSON parse, a schema that is an object, nesting depth. Compiling the constraint into a token mask is
the worker's (:mod:`services.worker.grammar`), bounded by :data:`COMPILE_TIMEOUT_S`; the gateway
first runs :func:`check_grammar` (llguidance's grammar check without the vocabulary: 1-26 ms), because a
worker's error text never reaches a caller. Messages name the field (``response_format`` over HTTP,
``sampling.structured`` over gRPC) and the limit.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

from services.common.errors import InvalidArgument

Kind = Literal["json_schema", "json_object", "regex", "grammar"]
KINDS: tuple[Kind, ...] = ("json_schema", "json_object", "regex", "grammar")

MAX_CONSTRAINT_BYTES = 32 * 1024
"""Largest schema, regex or grammar text, in UTF-8 bytes (a 200-property schema is ~8 KiB)."""
MAX_SCHEMA_DEPTH = 64
"""Deepest nesting of JSON objects and arrays in a schema document (a nested object property costs
two levels: its schema and the ``properties`` around it, so ~30 nested objects fit). vLLM users hit
unbounded compile times with deep and wide schemas (vllm#54003); this is the cheap first fence, the
compiler's own limits and :data:`COMPILE_TIMEOUT_S` the others."""
COMPILE_TIMEOUT_S = 2.0
"""Longest a worker spends compiling one constraint before refusing it (400 / INVALID_ARGUMENT).
llguidance compiles the realistic and large schemas of docs/structured_output.md in 1-12 ms."""

JSON_OBJECT_SCHEMA = '{"type":"object"}'
"""What ``json_object`` compiles to: any JSON object (OpenAI's JSON mode)."""
FIELD = "response_format (sampling.structured)"
"""How compile errors name the constraint (the gateway and the workers do not know the front door)."""
MAX_ERROR_CHARS = 200
JSON_LAYOUT: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
"""JSON is written as Python's ``json.dumps`` writes it (``{"a": 1, "b": [2, 3]}``): free whitespace
let the model spend its tokens on newlines and spaces (SmolLM2 did), and a fixed layout keeps answers
short. A schema may override it with llguidance's ``x-guidance`` key."""


@dataclass(frozen=True)
class Constraint:
    """What the generated text must match. Build it with :func:`check_constraint`."""

    kind: Kind
    text: str = ""
    """The schema (compact JSON, keys in the caller's order), the regex or the grammar; empty for ``json_object``."""

    @property
    def digest(self) -> str:
        """A stable hash of the constraint: the compiled-grammar cache key and the response-cache key's part."""
        return hashlib.sha256(f"{self.kind}\0{self.text}".encode()).hexdigest()[:32]

    def canonical(self) -> dict[str, str]:
        return {"kind": self.kind, "digest": self.digest}


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of a parsed JSON value, stopping once past ``limit`` (no recursion)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)
    return deepest


def check_constraint(kind: str, text: str = "", *, field: str = "sampling.structured") -> Constraint:
    """A checked :class:`Constraint` (cheap checks only; compiling is the worker's).

    ``field`` names the request field in error messages (``response_format`` for the HTTP API).
    Raises :class:`InvalidArgument` for an unknown kind, text over :data:`MAX_CONSTRAINT_BYTES`, a
    schema that is not a JSON object, nested deeper than :data:`MAX_SCHEMA_DEPTH`, or an empty regex
    or grammar.
    """
    if kind not in KINDS:
        raise InvalidArgument(f"{field} kind {kind!r} is unknown; use one of {', '.join(KINDS)}")
    if kind == "json_object":
        return Constraint("json_object")
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_CONSTRAINT_BYTES:
        raise InvalidArgument(
            f"{field}: the {kind} is {size} bytes, above the limit of {MAX_CONSTRAINT_BYTES}; send a smaller one"
        )
    if kind != "json_schema":
        if not text:
            raise InvalidArgument(f"{field}: the {kind} is empty; send a non-empty {kind}")
        return Constraint(kind, text)
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"{field}: the json_schema is not valid JSON ({exc.msg}); send a JSON object") from None
    return Constraint("json_schema", schema_text(schema, field=field))


def schema_text(schema: object, *, field: str = "sampling.structured") -> str:
    """The canonical text of a parsed JSON schema (compact, keys in their order), after the schema checks."""
    if not isinstance(schema, dict):
        raise InvalidArgument(f"{field}: the json_schema must be a JSON object (got {type(schema).__name__})")
    depth = _depth(schema, MAX_SCHEMA_DEPTH)
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidArgument(
            f"{field}: the json_schema nests deeper than the limit of {MAX_SCHEMA_DEPTH} levels; flatten it"
        )
    # Keys keep their order: llguidance writes an object's properties in the schema's order (a call's
    # ``name`` before its ``arguments``, a caller's fields as they listed them), so sorting them here
    # reordered every answer, and a schema whose keys come in another order is another constraint.
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    if len(text.encode("utf-8", "surrogatepass")) > MAX_CONSTRAINT_BYTES:
        raise InvalidArgument(
            f"{field}: the json_schema is over the limit of {MAX_CONSTRAINT_BYTES} bytes; send a smaller one"
        )
    return text


def json_schema_constraint(schema: dict[str, Any], *, field: str = "sampling.structured") -> Constraint:
    """Constrain generation to JSON valid against ``schema`` (a parsed JSON Schema object).

    The helper other code calls (tool-call arguments, ``/v1/responses``' ``text.format``): put the
    result in ``SamplingParams.structured``. Raises :class:`InvalidArgument` as :func:`check_constraint`.
    """
    return Constraint("json_schema", schema_text(schema, field=field))


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint (unchecked: :func:`check_grammar` or compiling checks it)."""
    try:
        if constraint.kind in ("json_object", "json_schema"):
            schema = JSON_OBJECT_SCHEMA if constraint.kind == "json_object" else constraint.text
            return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT))
        if constraint.kind == "regex":
            return str(llguidance.LLMatcher.grammar_from_regex(constraint.text))
        return str(llguidance.LLMatcher.grammar_from_lark(constraint.text))
    except ValueError as exc:
        raise InvalidArgument(f"{FIELD}: the {constraint.kind} is not valid ({short_error(exc)}); fix it") from None


def check_grammar(constraint: Constraint) -> None:
    """Raise InvalidArgument naming the field when llguidance refuses the constraint (bad regex or Lark,
    unsupported schema keyword). Blocking, 1-26 ms for the schemas of docs/structured_output.md: run it
    off the event loop, bounded by :data:`COMPILE_TIMEOUT_S`."""
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_text(constraint))
    if failed:
        raise InvalidArgument(
            f"{FIELD}: the {constraint.kind} is not valid or not supported ({short_error(messages[0])}); fix it"
        )


def short_error(error: object) -> str:
    """A library's error message on one line, cut to :data:`MAX_ERROR_CHARS`."""
    text = " ".join(str(error).split())
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."
