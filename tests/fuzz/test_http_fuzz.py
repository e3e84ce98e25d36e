"""Fuzz the HTTP front door (Envoy -> OpenAI adapter -> gateway) with hostile requests.

Cases: OpenAI-shaped JSON with any types in any field, JSON text mutated into malformed JSON or
invalid UTF-8, bodies around and beyond the 4 MiB limit, and header abuse (missing, malformed, huge
or duplicated ``Authorization``, junk and non-ASCII headers, odd content types), on the API paths
and on unknown ones, with several methods.

Properties of every case:
* a complete HTTP response arrives within ``CASE_TIMEOUT_S`` (no hung request);
* its status is below 500, or exactly 503 carrying OpenAI error JSON of type
  ``service_unavailable`` (the documented answer when no worker can take a request; an Envoy
  "no healthy upstream" 503, plain text, fails the property because it means a process behind Envoy
  died) — no 500, 502 or 504;
* no body contains traceback text; an error body of the adapter is OpenAI error JSON;
* a 200 event stream is well formed: ``data:`` JSON events ending in ``[DONE]`` or an error event
  whose type is not ``server_error``;
and after each test every service is SERVING and no service logged an error (conftest).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.local.mesh import DEV_API_KEY, Mesh
from tests.fuzz import http_raw
from tests.fuzz.conftest import assert_no_traceback, examples, record
from tests.fuzz.strategies import invalid_unicode, json_bytes, json_texts

pytestmark = pytest.mark.fuzz

CASE_TIMEOUT_S = 60.0
PATHS = ["/v1/chat/completions", "/v1/completions"]
GOOD_AUTH = [(b"Authorization", b"Bearer " + DEV_API_KEY.encode())]

# JSON values of every type, for any field; every string (keys too) is sometimes invalid Unicode.
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), json_texts(st.text(max_size=20))
)
ANY_JSON = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(json_texts(st.text(max_size=8)), inner, max_size=3),
    max_leaves=8,
)


def _mostly(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(valid, valid, valid, ANY_JSON)


_text = json_texts(st.one_of(st.just("Say hi."), st.text(min_size=1, max_size=20)))
_message = st.fixed_dictionaries(
    {
        "role": _mostly(json_texts(st.sampled_from(["system", "user", "assistant", "developer"]))),
        "content": _mostly(_text),
    },
    optional={"name": ANY_JSON},
)
_common = {
    "model": _mostly(json_texts(st.just(""))),
    "max_tokens": _mostly(st.integers(0, 6)),
    "max_completion_tokens": _mostly(st.integers(0, 6)),
    "temperature": _mostly(st.floats(0, 2)),
    "top_p": _mostly(st.floats(0, 1)),
    "stream": _mostly(st.booleans()),
    "stream_options": _mostly(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "stop": _mostly(st.one_of(_text, st.lists(_text, max_size=3))),
    "seed": _mostly(st.integers(0, 2**64)),
    "n": _mostly(st.integers(0, 2)),
    "frequency_penalty": _mostly(st.floats(-2, 2)),
    "presence_penalty": _mostly(st.floats(-2, 2)),
    "repetition_penalty": _mostly(st.floats(0.5, 2)),
    "logit_bias": _mostly(st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100), max_size=3)),
    "min_tokens": _mostly(st.integers(0, 4)),
    "user": ANY_JSON,
    "logprobs": _mostly(st.one_of(st.booleans(), st.integers(0, 5))),  # chat: a boolean; completions: 0-5
    "top_logprobs": _mostly(st.integers(0, 20)),
    "tools": ANY_JSON,
    "echo": ANY_JSON,
}
CHAT_BODY = st.fixed_dictionaries(
    {"messages": _mostly(st.lists(_message, min_size=1, max_size=3))},
    optional=_common | {"extra": ANY_JSON},
)
COMPLETION_BODY = st.fixed_dictionaries(
    {"prompt": _mostly(st.one_of(_text, st.lists(_text, min_size=1, max_size=2)))},
    optional=_common | {"suffix": ANY_JSON},
)


encode_json = json_bytes


def mangle(data: bytes, how: str, at: int, junk: bytes) -> bytes:
    """A valid JSON encoding turned into malformed JSON or invalid UTF-8 (or left valid)."""
    i = at % (len(data) + 1)
    if how == "truncate":
        return data[:i]
    if how == "splice":
        return data[:i] + junk + data[i:]
    if how == "latin1":  # bytes that are not UTF-8 inside an otherwise plausible body
        return data[:i] + b"\xff\xfe\xc3\x28\xa0\xa1" + data[i:]
    if how == "utf16":
        return data.decode("utf-8", "surrogatepass").encode("utf-16", "surrogatepass")
    return data


def check(test: str, response: http_raw.Response) -> None:
    record(test, str(response.status))
    text = response.body.decode("utf-8", "replace")
    assert_no_traceback(text, f"{test} HTTP {response.status}")
    if response.status >= 500:
        assert response.status == 503, f"{test}: HTTP {response.status}: {text[:300]!r}"
        error = json.loads(text)["error"]
        assert error["type"] == "service_unavailable", error
    if response.status >= 400 and (response.header("content-type") or "").startswith("application/json"):
        error = json.loads(text)["error"]
        assert isinstance(error["message"], str) and error["message"], error
    if response.status == 200 and response.events:
        last = response.events[-1]
        assert last == "[DONE]" or "error" in last, f"{test}: the event stream did not end: {last!r}"
        for event in response.events:
            if isinstance(event, dict) and "error" in event:
                assert event["error"]["type"] != "server_error", event


async def post(mesh: Mesh, path: str, headers: list[tuple[bytes, bytes]], body: bytes) -> http_raw.Response:
    assert mesh.front_door is not None
    request = http_raw.build("POST", path, [(b"Content-Type", b"application/json"), *headers], body)
    return await http_raw.send(mesh.front_door.port, request, CASE_TIMEOUT_S)


@examples(60)
@given(
    endpoint=st.sampled_from(["chat", "completion"]),
    data=st.data(),
    ensure_ascii=st.booleans(),
)
async def test_openai_json_bodies(fuzz_mesh: Mesh, endpoint: str, data: st.DataObject, ensure_ascii: bool) -> None:
    body = data.draw(CHAT_BODY if endpoint == "chat" else COMPLETION_BODY)
    path = PATHS[0] if endpoint == "chat" else PATHS[1]
    response = await post(fuzz_mesh, path, GOOD_AUTH, encode_json(body, ensure_ascii))
    check("http_json", response)


@examples(50)
@given(
    path=st.sampled_from(PATHS),
    body=st.one_of(CHAT_BODY, COMPLETION_BODY, ANY_JSON),
    how=st.sampled_from(["truncate", "splice", "latin1", "utf16", "none"]),
    at=st.integers(0, 2**16),
    junk=st.binary(min_size=1, max_size=12),
)
async def test_malformed_json_and_invalid_utf8(
    fuzz_mesh: Mesh, path: str, body: Any, how: str, at: int, junk: bytes
) -> None:
    payload = mangle(encode_json(body, ensure_ascii=False), how, at, junk)
    check("http_malformed", await post(fuzz_mesh, path, GOOD_AUTH, payload))


# Where a string sits in a valid body, and the adapter's name for that place.
_STRING_FIELDS = {
    "chat": [
        (("messages", 0, "content"), "'messages[0].content'"),
        (("messages", 0, "role"), "'messages[0].role'"),
        (("model",), "'model'"),
        (("stop", 1), "'stop[1]'"),
        (("user",), "'user'"),
        (("messages", 0, "content", 0, "text"), "'messages[0].content[0].text'"),
    ],
    "completion": [(("prompt",), "'prompt'"), (("prompt", 0), "'prompt[0]'"), (("stop",), "'stop'")],
}


def _valid_body(endpoint: str, place: tuple[str | int, ...]) -> dict[str, Any]:
    if endpoint == "completion":
        return {"prompt": ["Say hi."] if place == ("prompt", 0) else "Say hi.", "max_tokens": 2, "stop": "x"}
    content: Any = [{"type": "text", "text": "Say hi."}] if len(place) == 5 else "Say hi."
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2, "model": "", "stop": ["a", "b"]}


@examples(40)
@given(
    endpoint=st.sampled_from(["chat", "completion"]),
    data=st.data(),
    bad=invalid_unicode(),
    stream=st.booleans(),
)
async def test_invalid_unicode_escapes_are_400_naming_the_field(
    fuzz_mesh: Mesh, endpoint: str, data: st.DataObject, bad: str, stream: bool
) -> None:
    """A lone or reversed surrogate escape in any string field: 400 naming that field (was a 500 and
    a traceback in the adapter's log)."""
    place, name = data.draw(st.sampled_from(_STRING_FIELDS[endpoint]))
    body = _valid_body(endpoint, place)
    body["stream"] = stream
    target: Any = body
    for step in place[:-1]:
        target = target[step]
    target[place[-1]] = bad
    response = await post(fuzz_mesh, PATHS[0] if endpoint == "chat" else PATHS[1], GOOD_AUTH, json_bytes(body, True))
    check("http_bad_unicode", response)
    assert response.status == 400, response
    message = json.loads(response.body)["error"]["message"]
    assert message.startswith(f"{name} is not valid Unicode"), message


# Header abuse: (name, value) pairs as raw bytes.
_token = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz0123456789-_"), min_size=1, max_size=20)
_value = st.binary(max_size=64).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"").strip())
AUTH_VALUES = st.one_of(
    st.just(b"Bearer " + DEV_API_KEY.encode()),
    st.builds(lambda v: b"Bearer " + v, _value),
    st.builds(lambda v: b"Basic " + v, _value),
    _value,
    st.just(b"Bearer " + b"k" * 20_000),
    st.just(b"Bearer " + b"k" * 100_000),
)
HEADERS = st.lists(
    st.one_of(
        st.tuples(st.just(b"Authorization"), AUTH_VALUES),
        st.tuples(st.just(b"x-api-key"), _value),
        st.tuples(st.sampled_from([b"x-request-id", b"x-meshserve-tenant", b"x-meshserve-internal-token"]), _value),
        # Not application/grpc: Envoy sends those to the gateway as gRPC, fuzzed in test_grpc_fuzz.py.
        st.tuples(
            st.just(b"Content-Type"),
            st.sampled_from([b"text/plain", b"application/x-www-form-urlencoded", b"", b"\xff"]),
        ),
        st.tuples(_token.map(str.encode), _value),
        st.tuples(st.just(b"X-Big"), st.integers(1, 200_000).map(lambda n: b"v" * n)),
    ),
    max_size=6,
)


@examples(50)
@given(
    method=st.sampled_from(["POST", "POST", "GET", "PUT", "DELETE", "OPTIONS"]),
    path=st.sampled_from(
        [*PATHS, "/v1/models", "/v1/models/x", "/v1/../etc/passwd", "/nope", "/v1/chat/completions?x=1"]
    ),
    headers=HEADERS,
    with_good_key=st.booleans(),
)
async def test_header_abuse(
    fuzz_mesh: Mesh, method: str, path: str, headers: list[tuple[bytes, bytes]], with_good_key: bool
) -> None:
    assert fuzz_mesh.front_door is not None
    body = json.dumps({"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}).encode()
    if path.startswith("/v1/completions"):
        body = json.dumps({"prompt": "Say hi.", "max_tokens": 2}).encode()
    all_headers = (GOOD_AUTH if with_good_key else []) + headers
    request = http_raw.build(method, path, all_headers, body)
    check("http_headers", await http_raw.send(fuzz_mesh.front_door.port, request, CASE_TIMEOUT_S))


@pytest.mark.parametrize("size", [1 << 20, (4 << 20) - 64, (4 << 20) + 1, 12 << 20])
async def test_huge_bodies(fuzz_mesh: Mesh, size: int) -> None:
    """Bodies of 1 MiB to 12 MiB, around the adapter's 4 MiB limit: 400 (prompt too long) or 413.

    Over the limit the server answers 413 and closes while the client is still sending; the kernel
    then resets the connection, which can discard the 413 before the client reads it. A reset is
    therefore also a correct refusal of an oversized upload (never a 5xx; the mesh stays healthy,
    which the fixture checks after the test)."""
    for path in PATHS:
        key = "prompt" if path.endswith("/completions") and "chat" not in path else "messages"
        filler = "a" * size
        value: Any = filler if key == "prompt" else [{"role": "user", "content": filler}]
        try:
            response = await post(fuzz_mesh, path, GOOD_AUTH, json.dumps({key: value}).encode())
        except ConnectionResetError:
            assert size > 4 << 20, f"a {size}-byte body (under the limit) was reset"
            record("http_huge", "reset after refusing the upload")
            continue
        check("http_huge", response)
        assert response.status in (400, 413), response.status


@pytest.mark.parametrize(("size", "status"), [(4 * 1024, 401), (9 * 1024, 400), (30 * 1024, 400), (58 * 1024, 400)])
async def test_long_credentials_get_a_clear_4xx(fuzz_mesh: Mesh, size: int, status: int) -> None:
    """Regressions found by this fuzzer: (1) a header Envoy accepts (< 60 KiB) but longer than
    aiohttp's 8 KiB default made the adapter log a traceback; (2) an Authorization header over gRPC's
    16 KiB metadata limit came back as 429 rate_limit_exceeded. Now: 401 for a short wrong key, 400
    naming the header for one over 8 KiB, and nothing logged at error level."""
    assert fuzz_mesh.front_door is not None
    body = json.dumps({"prompt": "Say hi.", "max_tokens": 2}).encode()
    request = http_raw.build("POST", PATHS[1], [(b"Authorization", b"Bearer " + b"k" * size)], body)
    response = await http_raw.send(fuzz_mesh.front_door.port, request, CASE_TIMEOUT_S)
    check("http_headers", response)
    assert response.status == status, response
    if status == 400:
        assert "authorization header is longer" in json.loads(response.body)["error"]["message"]


@pytest.mark.parametrize("header", [b"Authorization", b"x-api-key"])
@pytest.mark.parametrize("value", [b"\xc0", b"Bearer \xc3\xa9t\xc3\xa9", b"Bearer a\x7fb"])
async def test_non_ascii_credentials_get_400_not_a_hang(fuzz_mesh: Mesh, header: bytes, value: bytes) -> None:
    """Regression found by the long fuzz run: a non-ASCII credential made grpc.aio fail the adapter's
    Chat call before it started, and the request hung until the client gave up."""
    assert fuzz_mesh.front_door is not None
    body = json.dumps({"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}).encode()
    request = http_raw.build("POST", PATHS[0], [(header, value)], body)
    response = await http_raw.send(fuzz_mesh.front_door.port, request, CASE_TIMEOUT_S)
    check("http_headers", response)
    assert response.status in (400, 401), response
