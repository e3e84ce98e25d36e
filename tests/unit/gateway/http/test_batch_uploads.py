"""POST /v1/files: a malformed or oversized multipart body is a 400 naming the problem, never a 500
(the adapter's routes on a real aiohttp server; the gateway's Batches stub is a fake)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from services.common.pb.meshserve.v1 import batch_pb2 as pb
from services.gateway.http.app import errors_middleware
from services.gateway.http.batches import BatchRoutes, add_routes

PART = b'--zz\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n'
MULTIPART = {"Content-Type": "multipart/form-data; boundary=zz"}


class FakeBatches:
    async def CreateFile(self, request: pb.CreateFileRequest, metadata: object = None) -> pb.FileObject:
        return pb.FileObject(
            id="file-x", bytes=len(request.content), filename=request.filename, purpose=request.purpose
        )


async def _no_json(_request: web.Request) -> dict[str, object]:
    return {}


@pytest.fixture
async def url() -> AsyncIterator[str]:
    app = web.Application(middlewares=[errors_middleware])
    add_routes(app, BatchRoutes(FakeBatches(), lambda _r: (), _no_json, max_file_bytes=100))  # type: ignore[arg-type]
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}/v1/files"
    await runner.cleanup()


@pytest.mark.parametrize(
    ("headers", "body", "message"),
    [
        ({"Content-Type": "multipart/form-data"}, b"x", "could not be read"),
        (MULTIPART, b"garbage", "could not be read"),
        (MULTIPART, PART + b"abc", "could not be read"),
        (MULTIPART, PART + b"x" * 500 + b"\r\n--zz--\r\n", "larger than 100 bytes"),
        ({"Content-Type": "application/json"}, b"{}", "multipart/form-data"),
        (MULTIPART, b"--zz--\r\n", "'file' field is missing"),
    ],
)
async def test_bad_uploads_are_400(url: str, headers: dict[str, str], body: bytes, message: str) -> None:
    async with aiohttp.ClientSession() as session, session.post(url, headers=headers, data=body) as reply:
        assert reply.status == 400
        assert message in (await reply.json())["error"]["message"]


async def test_an_upload(url: str) -> None:
    purpose = b'--zz\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    async with aiohttp.ClientSession() as session:
        async with session.post(url, headers=MULTIPART, data=purpose + PART + b"abc\r\n--zz--\r\n") as reply:
            assert reply.status == 200
            assert await reply.json() == {
                "id": "file-x",
                "object": "file",
                "bytes": 3,
                "created_at": 0,
                "filename": "a.jsonl",
                "purpose": "batch",
                "status": "processed",
                "status_details": None,
                "expires_at": None,
            }
