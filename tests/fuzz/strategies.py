"""Hypothesis strategies built from protobuf descriptors, so a field added to a .proto is fuzzed at once.

:func:`message` walks a message descriptor: every scalar type gets values over its whole wire range
(open enums include unknown numbers, floats include NaN and infinities, strings include long ones),
repeated fields get lists, real oneofs get at most one member, proto3 ``optional`` fields may be
unset. ``BIASES`` makes a few fields (by full name) valid three times in four, so that most cases get
past the gateway's validation into the router and the worker; the whole range stays reachable
(``max_tokens`` still reaches 2**32 - 1). A new field needs no entry: it gets its type's full range.
:func:`wire_mutations` turns a valid encoding into corrupt wire bytes (truncated, bit-flipped,
spliced), which is what a buggy or hostile client sends.
"""

from __future__ import annotations

import json
from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, OneofDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

F = FieldDescriptor

_INT_RANGES = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1),
    F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1),
    F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1),
    F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1),
    F.TYPE_FIXED64: (0, 2**64 - 1),
}

MAX_DEPTH = 4


def texts() -> st.SearchStrategy[str]:
    """Any Unicode text (no lone surrogates: protobuf cannot hold them), sometimes very long."""
    long = st.builds(lambda c, n: c * n, st.characters(codec="utf-8"), st.integers(1, 40_000))
    return st.one_of(st.text(), st.text(min_size=1, max_size=8), long)


def invalid_unicode() -> st.SearchStrategy[str]:
    """Text that JSON can carry (as ``\\uXXXX`` escapes) but Unicode forbids: a lone high or low
    surrogate, or a reversed pair (low, then high), among ordinary characters. Neither UTF-8 nor
    protobuf can hold it, so only JSON callers can send it (``json.dumps`` with ``ensure_ascii`` writes
    the escapes; without, :func:`json_bytes` writes the surrogates' invalid UTF-8 bytes)."""
    lone = st.integers(0xD800, 0xDFFF).map(chr)
    low, high = st.integers(0xDC00, 0xDFFF), st.integers(0xD800, 0xDBFF)
    reversed_pair = st.builds(lambda lo, hi: chr(lo) + chr(hi), low, high)
    around = st.text(max_size=4)  # st.text never holds a surrogate, so no valid pair can form
    return st.builds(lambda a, bad, b: a + bad + b, around, st.one_of(lone, reversed_pair), around)


JSON_BAD_TEXT_ONE_IN = 40


def json_texts(valid: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """``valid`` text, now and then :func:`invalid_unicode`: every string of a fuzzed JSON body.

    Rare per string (one choice in ``JSON_BAD_TEXT_ONE_IN``; hypothesis does not draw them uniformly: 7 %
    of 3,000 draws) because a body holds many strings: about one OpenAI body in five then holds one, and
    most bodies stay valid and reach the model. ``st.one_of`` with the same strategy repeated would not
    do: it merges the duplicates (74 % of draws were invalid)."""
    return st.sampled_from(range(JSON_BAD_TEXT_ONE_IN)).flatmap(lambda i: invalid_unicode() if i == 1 else valid)


def json_bytes(body: Any, ensure_ascii: bool) -> bytes:
    """``body`` as JSON bytes; lone surrogates become ``\\ud800`` escapes (``ensure_ascii``) or, without,
    the invalid UTF-8 bytes a careless encoder writes for them."""
    return json.dumps(body, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")


def ints(field: FieldDescriptor) -> st.SearchStrategy[int]:
    lo, hi = _INT_RANGES[field.type]
    small = st.integers(max(lo, -16), min(hi, 16))
    return st.one_of(small, st.integers(lo, hi), st.sampled_from([lo, hi]))


# Fields always given a value (which may still be the empty default, from the field's whole range):
# without them almost every case is refused by the same first check.
USUALLY_SET = frozenset(
    {
        "meshserve.v1.ChatTurn.messages",
        "meshserve.v1.GenerateRequest.prompt",
        "meshserve.internal.v1.WorkerStart.prompt_token_ids",
    }
)


def _mostly(valid: st.SearchStrategy[Any]) -> Any:
    """Three in four values from ``valid``, the rest from the field's whole range: most cases then get
    past validation and reach the router and the worker, and every branch of validation stays reachable."""
    return lambda anything: st.one_of(valid, valid, valid, anything)


_short = st.text(min_size=1, max_size=12)
_token_id = st.integers(0, 49151)  # the default model's vocabulary
# Field full name -> (the field's default strategy -> the strategy to use).
BIASES: dict[str, Any] = {
    "meshserve.v1.SamplingParams.max_tokens": _mostly(st.integers(0, 6)),
    "meshserve.v1.SamplingParams.temperature": _mostly(st.one_of(st.just(0.0), st.floats(0, 2, width=32))),
    "meshserve.v1.SamplingParams.top_p": _mostly(st.floats(0, 1, width=32)),
    "meshserve.v1.SamplingParams.top_k": _mostly(st.integers(0, 50)),
    "meshserve.v1.SamplingParams.stop": _mostly(st.lists(_short, max_size=2)),
    "meshserve.v1.SamplingParams.frequency_penalty": _mostly(st.floats(-2, 2, width=32)),
    "meshserve.v1.SamplingParams.presence_penalty": _mostly(st.floats(-2, 2, width=32)),
    "meshserve.v1.SamplingParams.repetition_penalty": _mostly(st.floats(0.5, 2, width=32)),
    "meshserve.v1.SamplingParams.logit_bias": _mostly(
        st.dictionaries(_token_id, st.floats(-100, 100, width=32), max_size=3)
    ),
    "meshserve.v1.SamplingParams.min_tokens": _mostly(st.integers(0, 4)),
    "meshserve.v1.SamplingParams.n": _mostly(st.integers(1, 3)),
    "meshserve.v1.SamplingParams.top_logprobs": _mostly(st.integers(0, 20)),
    "meshserve.v1.RoutingOptions.priority": _mostly(st.integers(0, 9)),
    "meshserve.v1.RoutingOptions.tier": _mostly(st.sampled_from([0, 1, 2, 3])),
    "meshserve.v1.RoutingOptions.cache_policy": _mostly(st.sampled_from([0, 1, 2, 3])),
    "meshserve.v1.GenerateRequest.model": _mostly(st.just("")),
    "meshserve.v1.ChatTurn.model": _mostly(st.just("")),
    "meshserve.v1.GenerateRequest.prompt": _mostly(st.one_of(st.just("Say hi."), _short)),
    "meshserve.v1.ChatMessage.role": _mostly(st.sampled_from(["system", "user", "assistant"])),
    # The internal worker stream (tests/fuzz/test_internal_fuzz.py): token ids of the default model's
    # vocabulary, a few of them, as the router sends.
    "meshserve.internal.v1.WorkerStart.prompt_token_ids": _mostly(st.lists(_token_id, min_size=1, max_size=8)),
    "meshserve.internal.v1.WorkerStart.resume_token_ids": _mostly(st.lists(_token_id, max_size=3)),
    # Cache.Warm: each prompt is a real generation request through the router.
    "meshserve.internal.v1.WarmRequest.prompts": _mostly(st.lists(st.one_of(st.just("Say hi."), _short), max_size=2)),
    "meshserve.internal.v1.WarmRequest.max_tokens": _mostly(st.integers(0, 4)),
    "meshserve.v1.ChatMessage.content": _mostly(st.one_of(st.just("Say hi."), _short)),
    "meshserve.v1.ChatTurn.messages": _mostly(
        st.lists(
            st.builds(
                lambda role, content: {"role": role, "content": content},
                st.sampled_from(["system", "user", "assistant"]),
                st.one_of(st.just("Say hi."), _short),
            ),
            min_size=1,
            max_size=3,
        )
    ),
}


def scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t in _INT_RANGES:
        return ints(field)
    if t == F.TYPE_FLOAT:
        return st.one_of(st.floats(width=32), st.floats(0, 2, width=32))
    if t == F.TYPE_DOUBLE:
        return st.floats()
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_STRING:
        return texts()
    if t == F.TYPE_BYTES:
        return st.binary()
    if t == F.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-(2**31), 2**31 - 1))
    raise TypeError(f"no strategy for field {field.full_name} of type {t}")


def value(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    entry = field.message_type if field.type == F.TYPE_MESSAGE else None
    if entry is not None and entry.GetOptions().map_entry:  # a map<K, V>: a dict
        key, val = entry.fields_by_name["key"], entry.fields_by_name["value"]
        mapping = st.dictionaries(value(key, depth + 1), value(val, depth + 1), max_size=4 if depth < MAX_DEPTH else 0)
        bias = BIASES.get(field.full_name)
        return bias(mapping) if bias is not None else mapping
    single = message(field.message_type, depth + 1) if entry is not None else scalar(field)
    if field.is_repeated:
        strategy: st.SearchStrategy[Any] = st.lists(single, max_size=4 if depth < MAX_DEPTH else 0)
    else:
        strategy = single
    bias = BIASES.get(field.full_name)
    return bias(strategy) if bias is not None else strategy


def _synthetic(oneof: OneofDescriptor) -> bool:
    """The hidden oneof protoc makes for a proto3 ``optional`` field."""
    return len(oneof.fields) == 1 and oneof.name == f"_{oneof.fields[0].name}"


def message(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of ``descriptor``'s type with any subset of its fields set to any values."""
    cls = message_factory.GetMessageClass(descriptor)
    if depth > MAX_DEPTH:
        return st.just(cls())
    optional: dict[str, st.SearchStrategy[Any]] = {}
    choices: list[st.SearchStrategy[dict[str, Any]]] = []
    required: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        oneof = field.containing_oneof
        if oneof is not None and not _synthetic(oneof):
            continue
        target = required if field.full_name in USUALLY_SET else optional
        target[field.name] = st.deferred(lambda f=field: value(f, depth))
    for oneof in descriptor.oneofs:
        if _synthetic(oneof):
            continue
        members = [st.deferred(lambda f=f: value(f, depth)).map(lambda v, name=f.name: {name: v}) for f in oneof.fields]
        choices.append(st.one_of(st.just({}), *members))
    oneofs = st.tuples(*choices).map(lambda parts: {k: v for part in parts for k, v in part.items()})
    fields = st.fixed_dictionaries(required, optional=optional)
    return st.builds(lambda a, b: cls(**a, **b), fields, oneofs)


BAD_UTF8_MARK = "\U0010fffdmeshserve-bad-utf8"
"""A text value whose first 4 encoded bytes (``f4 8f bf bd``) :func:`bad_utf8_messages` overwrites with
4 bytes that are not UTF-8 (``ed a0 80`` encodes a surrogate), so every length prefix stays right."""
_BAD_4 = b"\xed\xa0\x80A"


def string_paths(descriptor: Descriptor, depth: int = 0) -> list[tuple[FieldDescriptor, ...]]:
    """Every path from ``descriptor`` to a ``string`` field, through message fields (not maps)."""
    paths: list[tuple[FieldDescriptor, ...]] = []
    for field in descriptor.fields:
        if field.type == F.TYPE_STRING:
            paths.append((field,))
        elif field.type == F.TYPE_MESSAGE and depth < 3 and not field.message_type.GetOptions().map_entry:
            paths += [(field, *rest) for rest in string_paths(field.message_type, depth + 1)]
    return paths


def _plant(message: Message, path: tuple[FieldDescriptor, ...]) -> str:
    """Set the field at ``path`` to :data:`BAD_UTF8_MARK` (appending to repeated fields); returns the
    name the gateway reports for it (``turn.messages[2].content``)."""
    names: list[str] = []
    target = message
    for field in path[:-1]:
        if field.is_repeated:
            names.append(f"{field.name}[{len(getattr(target, field.name))}]")
            target = getattr(target, field.name).add()
        else:
            names.append(field.name)
            target = getattr(target, field.name)
    last = path[-1]
    if last.is_repeated:
        names.append(f"{last.name}[{len(getattr(target, last.name))}]")
        getattr(target, last.name).append(BAD_UTF8_MARK)
    else:
        names.append(last.name)
        setattr(target, last.name, BAD_UTF8_MARK)
    return ".".join(names)


def bad_utf8_messages(descriptor: Descriptor) -> st.SearchStrategy[tuple[bytes, str]]:
    """Encodings of messages of ``descriptor``'s type whose one ``string`` field (any, at any depth
    reached through message fields) holds bytes that are not UTF-8, with that field's reported name.
    A Python client cannot send these (protobuf refuses to encode them); a hostile one can."""

    def build(base: Message, path: tuple[FieldDescriptor, ...]) -> tuple[bytes, str]:
        name = _plant(base, path)
        data = base.SerializeToString()
        mark = BAD_UTF8_MARK.encode()
        assert data.count(mark) == 1, "the mark is planted once"
        return data.replace(mark, _BAD_4 + mark[4:]), name

    return st.builds(build, message(descriptor), st.sampled_from(string_paths(descriptor)))


def wire_mutations(encoded: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """Corrupt versions of valid encodings: truncated, a byte replaced, random bytes spliced in."""

    def truncate(data: bytes, at: int) -> bytes:
        return data[: at % (len(data) + 1)]

    def replace(data: bytes, at: int, byte: int) -> bytes:
        if not data:
            return bytes([byte])
        i = at % len(data)
        return data[:i] + bytes([byte]) + data[i + 1 :]

    def splice(data: bytes, at: int, junk: bytes) -> bytes:
        i = at % (len(data) + 1)
        return data[:i] + junk + data[i:]

    at = st.integers(0, 2**16)
    return st.one_of(
        st.builds(truncate, encoded, at),
        st.builds(replace, encoded, at, st.integers(0, 255)),
        st.builds(splice, encoded, at, st.binary(min_size=1, max_size=16)),
        st.binary(max_size=64),
    )
