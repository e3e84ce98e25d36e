"""OpenAI's Files (``/v1/files``) and Batch (``/v1/batches``) APIs, relayed to the gateway's
`meshserve.v1.Batches` service: OpenAI JSON and multipart in, one gRPC call with the caller's
credentials, OpenAI JSON out. Errors leave through the adapter's error middleware like any other.

An upload is read part by part up to ``max_file_bytes`` (not the adapter's JSON body limit): a
bigger file is refused with 400 before it is all read.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import BodyPartReader, web
from aiohttp.web_protocol import RequestPayloadError

from services.common.errors import InvalidArgument
from services.common.pb.meshserve.v1 import batch_pb2 as pb
from services.common.pb.meshserve.v1 import batch_pb2_grpc
from services.store.batches import TIMES

Metadata = Callable[[web.Request], tuple[tuple[str, str], ...]]
JsonBody = Callable[[web.Request], Awaitable[dict[str, Any]]]


def file_json(f: pb.FileObject) -> dict[str, Any]:
    return {
        "id": f.id,
        "object": "file",
        "bytes": f.bytes,
        "created_at": f.created_at,
        "filename": f.filename,
        "purpose": f.purpose,
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }


def batch_json(b: pb.BatchObject) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": b.id,
        "object": "batch",
        "endpoint": b.endpoint,
        "errors": None,
        "input_file_id": b.input_file_id,
        "completion_window": b.completion_window,
        "status": b.status,
        "output_file_id": b.output_file_id or None,
        "error_file_id": b.error_file_id or None,
        "request_counts": {
            "total": b.request_counts.total,
            "completed": b.request_counts.completed,
            "failed": b.request_counts.failed,
        },
        "metadata": dict(b.metadata) or None,
    }
    for name in TIMES:
        body[name] = getattr(b, name) or None
    return body


def _page(kind: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": kind,
        "first_id": kind[0]["id"] if kind else None,
        "last_id": kind[-1]["id"] if kind else None,
        "has_more": has_more,
    }


def _limit(request: web.Request, high: int) -> int:
    text = request.query.get("limit", "")
    if not text:
        return 0
    if not text.isdigit() or not 1 <= int(text) <= high:
        raise InvalidArgument(f"'limit' must be a whole number from 1 to {high} (got {text[:16]!r})")
    return int(text)


class BatchRoutes:
    """Handlers of /v1/files and /v1/batches bound to the gateway's Batches stub."""

    def __init__(
        self, stub: batch_pb2_grpc.BatchesStub, metadata: Metadata, json_body: JsonBody, max_file_bytes: int
    ) -> None:
        self._stub = stub
        self._metadata = metadata
        self._json = json_body
        self._max_file_bytes = max_file_bytes

    async def create_file(self, request: web.Request) -> web.Response:
        if not request.content_type.startswith("multipart/"):
            raise InvalidArgument("upload files as multipart/form-data with the fields 'file' and 'purpose'")
        try:
            purpose, filename, content = await self._form(request)
        except (ValueError, RequestPayloadError):  # aiohttp's refusals of a malformed multipart body
            raise InvalidArgument(
                "the multipart body could not be read (no boundary, or cut short); send multipart/form-data"
                " with the fields 'file' and 'purpose'"
            ) from None
        if not content:
            raise InvalidArgument("the 'file' field is missing or empty; upload JSONL, one request per line")
        reply = await self._stub.CreateFile(
            pb.CreateFileRequest(filename=filename, purpose=purpose, content=content), metadata=self._metadata(request)
        )
        return web.json_response(file_json(reply))

    async def _form(self, request: web.Request) -> tuple[str, str, bytes]:
        """(purpose, filename, file bytes) of an upload's multipart body."""
        reader = await request.multipart()
        purpose, filename, content = "", "", b""
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                raise InvalidArgument("nested multipart bodies are not supported; send the fields 'file' and 'purpose'")
            if part.name == "purpose":
                purpose = (await part.read(decode=True)).decode(errors="replace")[:64]
            elif part.name == "file":
                filename = part.filename or "upload.jsonl"
                content = await self._read_file(part)
            else:
                await part.release()
        return purpose, filename, content

    async def _read_file(self, part: BodyPartReader) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while chunk := await part.read_chunk(256 * 1024):
            size += len(chunk)
            if size > self._max_file_bytes:
                raise InvalidArgument(
                    f"the file is larger than {self._max_file_bytes} bytes; split it into several batches"
                )
            chunks.append(chunk)
        return b"".join(chunks)

    async def list_files(self, request: web.Request) -> web.Response:
        msg = pb.ListFilesRequest(
            purpose=request.query.get("purpose", "")[:64],
            limit=_limit(request, 10_000),
            after=request.query.get("after", "")[:128],
        )
        reply = await self._stub.ListFiles(msg, metadata=self._metadata(request))
        return web.json_response(_page([file_json(f) for f in reply.files], reply.has_more))

    async def get_file(self, request: web.Request) -> web.Response:
        reply = await self._stub.GetFile(self._file(request), metadata=self._metadata(request))
        return web.json_response(file_json(reply))

    async def file_content(self, request: web.Request) -> web.StreamResponse:
        call = self._stub.GetFileContent(self._file(request), metadata=self._metadata(request))
        try:
            pieces = aiter(call)
            first = await anext(pieces, None)  # the gateway's error (404, ...) before any header is sent
            response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
            await response.prepare(request)
            if first is not None:
                await response.write(first.content)
                async for piece in pieces:
                    await response.write(piece.content)
            await response.write_eof()
            return response
        finally:
            call.cancel()

    async def delete_file(self, request: web.Request) -> web.Response:
        reply = await self._stub.DeleteFile(self._file(request), metadata=self._metadata(request))
        return web.json_response({"id": reply.id, "object": "file", "deleted": reply.deleted})

    @staticmethod
    def _file(request: web.Request) -> pb.FileRef:
        return pb.FileRef(file_id=request.match_info["file_id"][:128])

    async def create_batch(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        fields = {name: body.get(name) for name in ("input_file_id", "endpoint", "completion_window")}
        for name, value in fields.items():
            if not isinstance(value, str) or not value:
                raise InvalidArgument(f"'{name}' must be a non-empty string")
        metadata = body.get("metadata") or {}
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise InvalidArgument("'metadata' must be an object of string keys and string values")
        msg = pb.CreateBatchRequest(metadata=metadata, **fields)  # type: ignore[arg-type]
        reply = await self._stub.CreateBatch(msg, metadata=self._metadata(request))
        return web.json_response(batch_json(reply))

    async def list_batches(self, request: web.Request) -> web.Response:
        msg = pb.ListBatchesRequest(limit=_limit(request, 100), after=request.query.get("after", "")[:128])
        reply = await self._stub.ListBatches(msg, metadata=self._metadata(request))
        return web.json_response(_page([batch_json(b) for b in reply.batches], reply.has_more))

    async def get_batch(self, request: web.Request) -> web.Response:
        reply = await self._stub.GetBatch(self._batch(request), metadata=self._metadata(request))
        return web.json_response(batch_json(reply))

    async def cancel_batch(self, request: web.Request) -> web.Response:
        reply = await self._stub.CancelBatch(self._batch(request), metadata=self._metadata(request))
        return web.json_response(batch_json(reply))

    @staticmethod
    def _batch(request: web.Request) -> pb.BatchRef:
        return pb.BatchRef(batch_id=request.match_info["batch_id"][:128])


def add_routes(app: web.Application, routes: BatchRoutes) -> None:
    app.router.add_post("/v1/files", routes.create_file)
    app.router.add_get("/v1/files", routes.list_files)
    app.router.add_get("/v1/files/{file_id}", routes.get_file)
    app.router.add_delete("/v1/files/{file_id}", routes.delete_file)
    app.router.add_get("/v1/files/{file_id}/content", routes.file_content)
    app.router.add_post("/v1/batches", routes.create_batch)
    app.router.add_get("/v1/batches", routes.list_batches)
    app.router.add_get("/v1/batches/{batch_id}", routes.get_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", routes.cancel_batch)
