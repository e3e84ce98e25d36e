"""Invalid Unicode anywhere in a request, through the real Envoy, HTTP adapter and gateway: a 400 (HTTP)
or INVALID_ARGUMENT (gRPC) naming the field, never a 5xx, a hang or a traceback in a service's log.

JSON: ``"\\ud800"`` is valid JSON but names a lone surrogate, which no UTF-8 encoder takes (the adapter
answered 500 with a traceback before). Headers: bytes that are not UTF-8 (an encoded surrogate
``\\xed\\xa0\\x80``, ``\\xff``). gRPC: a string field holding bad UTF-8 on the wire, and metadata with
such bytes, sent as raw HTTP/1.1 through Envoy (grpc's own client refuses to send either).
"""

from __future__ import annotations

import json
import logging
import struct
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.controlplane.frontdoor import FrontDoor
from tests.fuzz import http_raw
from tests.helpers import RedisServer
from tests.integration.frontdoor.conftest import API_KEY, FakeRouter, start_gateway, start_router

pytestmark = pytest.mark.integration
AUTH = [(b"Authorization", b"Bearer " + API_KEY.encode())]
JSON = [(b"Content-Type", b"application/json")]
BAD_BYTES = [b"\xed\xa0\x80", b"\xff\xfe", b"caf\xc3"]


@dataclass
class Door:
    router: FakeRouter
    port: int
    address: str
    log: list[str]


def _bad(line: str) -> bool:
    return "Traceback" in line or '"level": "error"' in line or "[error]" in line or "[critical]" in line


@pytest.fixture(scope="module")
async def door(redis_srv: RedisServer) -> AsyncIterator[Door]:
    router = FakeRouter()
    router_server = await start_router(router)
    gateway_server = await start_gateway(router_server.port, redis_srv.url)
    log: list[str] = []
    try:
        async with FrontDoor([f"127.0.0.1:{gateway_server.port}"], lambda n, line: log.append(f"{n} | {line}")) as fd:
            yield Door(router, fd.port, fd.address, log)
    finally:
        await gateway_server.stop()
        await router_server.stop()


@pytest.fixture(autouse=True)
def clean_log(door: Door) -> None:
    door.log.clear()
    door.router.requests.clear()
    yield
    bad = [line for line in door.log if _bad(line)]
    assert not bad, "\n".join(bad)


async def _post(door: Door, path: str, raw_json: str, headers: list[tuple[bytes, bytes]] = AUTH) -> http_raw.Response:
    request = http_raw.build("POST", path, [*JSON, *headers], raw_json.encode())
    return await http_raw.send(door.port, request, 30)


def _message(response: http_raw.Response) -> str:
    return str(json.loads(response.body)["error"]["message"])


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (CHAT, '{"messages": [{"role": "user", "content": "\\ud800"}]}', "'messages[0].content'"),
        (CHAT, '{"messages": [{"role": "user", "content": "a\\udc00b"}]}', "'messages[0].content'"),
        (CHAT, '{"messages": [{"role": "user", "content": "\\ude00\\ud83d"}]}', "'messages[0].content'"),  # reversed
        (CHAT, '{"messages": [{"role": "us\\udbff", "content": "hi"}]}', "'messages[0].role'"),
        (
            CHAT,
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
            "'messages[0].content[0].text'",
        ),
        (CHAT, '{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}', "'model'"),
        (CHAT, '{"stop": ["ok", "\\udfff"], "messages": [{"role": "user", "content": "hi"}]}', "'stop[1]'"),
        (CHAT, '{"user": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}', "'user'"),
        (CHAT, '{"\\ud800": 1, "messages": [{"role": "user", "content": "hi"}]}', "a key of the request body"),
        (COMPLETIONS, '{"prompt": "\\ud800"}', "'prompt'"),
        (COMPLETIONS, '{"prompt": ["\\udc80"]}', "'prompt[0]'"),
        (COMPLETIONS, '{"prompt": "hi", "stream": true, "stop": "\\ud800"}', "'stop'"),
    ],
)
async def test_json_surrogate_escapes_are_400_naming_the_field(door: Door, path: str, body: str, field: str) -> None:
    response = await _post(door, path, body)
    assert response.status == 400, response
    message = _message(response)
    assert message.startswith(f"{field} is not valid Unicode"), message
    assert not door.router.requests  # refused before anything was sent on


async def test_a_valid_surrogate_pair_escape_is_served(door: Door) -> None:
    response = await _post(door, CHAT, '{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}')
    assert response.status == 200, response
    turn = door.router.requests[-1].turn  # type: ignore[attr-defined]
    assert turn.messages[0].content == "\U0001f600"


@pytest.mark.parametrize("name", [b"Authorization", b"x-api-key"])
@pytest.mark.parametrize("bad", BAD_BYTES)
async def test_credentials_with_invalid_utf8_are_400_naming_the_header(door: Door, name: bytes, bad: bytes) -> None:
    response = await _post(door, COMPLETIONS, '{"prompt": "hi"}', [(name, b"Bearer " + bad)])
    assert response.status == 400, response
    assert f"the {name.decode().lower()} header must be printable ASCII" in _message(response)


@pytest.mark.parametrize("name", [b"x-request-id", b"traceparent", b"tracestate", b"x-junk", b"user-agent"])
@pytest.mark.parametrize("bad", BAD_BYTES)
async def test_other_headers_with_invalid_utf8_do_not_fail_the_request(door: Door, name: bytes, bad: bytes) -> None:
    """Headers the mesh does not use (or drops when malformed, as W3C trace context says) are ignored."""
    response = await _post(door, COMPLETIONS, '{"prompt": "hi"}', [*AUTH, (name, bad)])
    assert response.status == 200, response


def _grpc_http1(method: str, payload: bytes, metadata: list[tuple[bytes, bytes]]) -> bytes:
    """A unary gRPC call as raw HTTP/1.1 bytes (Envoy routes content-type application/grpc to the gateway)."""
    headers = [(b"Content-Type", b"application/grpc"), (b"TE", b"trailers"), *metadata]
    frame = b"\x00" + struct.pack(">I", len(payload)) + payload
    return http_raw.build("POST", f"/meshserve.v1.Inference/{method}", headers, frame)


def _grpc_status(response: http_raw.Response) -> tuple[int, str]:
    """grpc-status of a trailers-only answer (an error), else OK: Envoy drops trailers on HTTP/1.1."""
    assert response.status == 200, response
    status = response.header("grpc-status")
    if status is None:
        assert response.body[:1] == b"\x00", response  # a response message: the call succeeded
        return 0, ""
    return int(status), urllib.parse.unquote(response.header("grpc-message") or "")


def _bad_utf8_prompt() -> bytes:
    """A GenerateRequest whose ``prompt`` (field 2) holds bytes that are not UTF-8."""
    good = pb.GenerateRequest(prompt="AB", model="").SerializeToString()
    assert b"AB" in good
    return good.replace(b"AB", b"\xed\xa0")


async def test_grpc_string_field_with_invalid_utf8_is_invalid_argument_naming_it(door: Door) -> None:
    metadata = [(b"authorization", b"Bearer " + API_KEY.encode())]
    request = _grpc_http1("Complete", _bad_utf8_prompt(), metadata)
    status, message = _grpc_status(await http_raw.send(door.port, request, 30))
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0], message
    assert "prompt" in message, message
    assert not door.router.requests


METADATA_KEYS = [b"authorization", b"x-api-key", b"x-request-id", b"x-meshserve-tenant", b"traceparent"]


@pytest.mark.parametrize("name", METADATA_KEYS)
@pytest.mark.parametrize("bad", BAD_BYTES)
async def test_grpc_metadata_with_invalid_utf8_is_invalid_argument_naming_the_key(
    door: Door, name: bytes, bad: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """grpc hands such a value to Python decoded as Latin-1 and logged a traceback for each read."""
    metadata = [(b"authorization", b"Bearer " + API_KEY.encode())] if name != b"authorization" else []
    metadata.append((name, b"Bearer " + bad if name in (b"authorization", b"x-api-key") else bad))
    for method in ("ListModels", "Complete"):
        payload = b"" if method == "ListModels" else pb.GenerateRequest(prompt="hi").SerializeToString()
        request = _grpc_http1(method, payload, metadata)
        status, message = _grpc_status(await http_raw.send(door.port, request, 30))
        assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0], message
        assert f"the {name.decode()!r} metadata is not printable ASCII" in message, message
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_grpc_metadata_that_is_valid_still_works(door: Door) -> None:
    metadata = [(b"authorization", b"Bearer " + API_KEY.encode()), (b"x-request-id", b"abc-123")]
    status, message = _grpc_status(await http_raw.send(door.port, _grpc_http1("ListModels", b"", metadata), 30))
    assert status == 0, message
