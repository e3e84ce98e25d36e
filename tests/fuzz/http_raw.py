"""A deliberately dumb HTTP/1.1 client: it sends the exact bytes it is given (duplicate, huge or
non-ASCII headers, wrong lengths, invalid UTF-8), so Envoy and the adapter see what a hostile client
would send. One request per connection (``Connection: close``), response read to EOF."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Response:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    events: list[Any] = field(default_factory=list)
    """Decoded ``data:`` events of a text/event-stream body (``"[DONE]"`` kept as a string)."""

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None


def build(method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes, length: bool = True) -> bytes:
    """Request bytes; ``Content-Length`` is added (correct) unless ``length`` is False."""
    lines = [method.encode() + b" " + path.encode() + b" HTTP/1.1", b"Host: 127.0.0.1", b"Connection: close"]
    lines += [name + b": " + value for name, value in headers]
    if length:
        lines.append(b"Content-Length: " + str(len(body)).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            break
        out += rest[:size]
        data = rest[size + 2 :]
    return bytes(out)


def parse(raw: bytes) -> Response:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = [(k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:])]
    response = Response(status, headers, body)
    if (response.header("transfer-encoding") or "").lower() == "chunked":
        response.body = _dechunk(body)
    if (response.header("content-type") or "").startswith("text/event-stream"):
        for block in response.body.decode().split("\n\n"):
            if block.startswith("data: "):
                payload = block[len("data: ") :]
                response.events.append(payload if payload == "[DONE]" else json.loads(payload))
    return response


def _complete(raw: bytes) -> bool:
    """Whether ``raw`` holds a whole response (so we need not wait for the server to close: Envoy
    keeps a connection it refused open for its 1 s delayed-close timeout)."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return False
    lowered = head.lower()
    for line in lowered.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return len(body) >= int(line.split(b":", 1)[1])
    if b"transfer-encoding: chunked" in lowered:
        return body.endswith(b"0\r\n\r\n")
    return False


async def _read_response(reader: asyncio.StreamReader) -> bytes:
    raw = b""
    while not _complete(raw):
        chunk = await reader.read(65536)
        if not chunk:
            break
        raw += chunk
    return raw


async def send(port: int, request: bytes, timeout_s: float) -> Response:
    """Send ``request`` to 127.0.0.1:``port`` and read the whole response (TimeoutError if it hangs)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        async with asyncio.timeout(timeout_s):
            try:
                writer.write(request)
                await writer.drain()
            except (ConnectionResetError, BrokenPipeError):
                pass  # the server answered (e.g. 413) and closed before taking the whole body
            raw = await _read_response(reader)
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass  # the server may reset a connection it refused; the response was already read
    return parse(raw)
