"""The public `meshserve.v1.Batches` service: OpenAI's Files and Batch APIs over the batch store.

Each call authenticates the caller (the same credentials as Inference, scope ``inference``), then
acts on its tenant's files and batches only (:mod:`services.store.files`, :mod:`services.store.batches`).
The gateway only records batches and queues their lines; the batch runners (services/batch) run
them. Quotas come from the tenant's policy: ``batch_file_bytes`` (files stored) and
``batch_lines_in_flight`` (lines of its unfinished batches); sizes from the gateway's settings.
Served always; without a Redis (``MESHSERVE_GATEWAY_STATE_REDIS_URL``, else ``MESHSERVE_GATEWAY_REDIS_URL``)
every call is UNAVAILABLE, saying so.
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Concatenate, ParamSpec, TypeVar

import grpc
import structlog
from redis.exceptions import RedisError

from services.common.errors import InvalidArgument, PermissionDenied, Unavailable
from services.common.pb.meshserve.v1 import batch_pb2 as pb
from services.common.pb.meshserve.v1 import batch_pb2_grpc
from services.gateway import scopes
from services.gateway.admission import Gate
from services.gateway.config import GatewaySettings
from services.gateway.identity import Identity
from services.store.batches import BatchRecord, BatchStore, parse_input, window_seconds
from services.store.files import FileRecord, FileStore

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Batches"].full_name
PURPOSE = "batch"
PIECE_BYTES = 1024 * 1024
"""Bytes per GetFileContent message."""
MAX_METADATA = 16
"""OpenAI's limit on a batch's metadata pairs (keys up to 64 characters, values up to 512)."""


def file_pb(f: FileRecord) -> pb.FileObject:
    return pb.FileObject(id=f.id, bytes=f.bytes, created_at=f.created_at, filename=f.filename, purpose=f.purpose)


def batch_pb(b: BatchRecord) -> pb.BatchObject:
    msg = pb.BatchObject(
        id=b.id,
        endpoint=b.endpoint,
        input_file_id=b.input_file_id,
        completion_window=b.completion_window,
        status=b.status,
        output_file_id=b.output_file_id,
        error_file_id=b.error_file_id,
        request_counts=pb.RequestCounts(total=b.total, completed=b.completed, failed=b.failed),
        metadata=dict(b.metadata),
        **{name: value for name, value in b.times.items()},
    )
    return msg


STORE_OUTAGE = "the file and batch store (Redis) is unavailable; retry in a few seconds"
P = ParamSpec("P")
R = TypeVar("R")


def _store_errors(
    method: Callable[Concatenate[BatchesServicer, P], Awaitable[R]],
) -> Callable[Concatenate[BatchesServicer, P], Awaitable[R]]:
    """A Redis that is down or restarting (the state Redis replaying its append-only file, say) makes
    the call UNAVAILABLE, which clients retry, not INTERNAL with a traceback in the log."""

    @functools.wraps(method)
    async def call(self: BatchesServicer, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await method(self, *args, **kwargs)
        except (RedisError, OSError) as exc:
            structlog.get_logger(__name__).warning("batch_store_unavailable", error=type(exc).__name__)
            raise Unavailable(STORE_OUTAGE) from None

    return call


def _check_id(name: str, value: str) -> None:
    if not value or len(value) > 64 or not value.replace("-", "").replace("_", "").isalnum():
        raise InvalidArgument(f"{name} {value[:64]!r} is not an id this server gave out; pass the id you were given")


class BatchesServicer(batch_pb2_grpc.BatchesServicer):
    """Files and batches of the caller's tenant (see the module docstring)."""

    def __init__(self, settings: GatewaySettings, gate: Gate, store: BatchStore | None) -> None:
        self._settings = settings
        self._gate = gate
        self._store_or_none = store

    @property
    def _store(self) -> BatchStore:
        if self._store_or_none is None:
            raise Unavailable(
                "files and batches need Redis; the operator must set MESHSERVE_GATEWAY_STATE_REDIS_URL "
                "or MESHSERVE_GATEWAY_REDIS_URL"
            )
        return self._store_or_none

    @property
    def _files(self) -> FileStore:
        return self._store.files

    async def _identify(self, context: grpc.aio.ServicerContext) -> Identity:
        self._store  # noqa: B018 (refuses at once without Redis)
        identity = await self._gate.identify(context.invocation_metadata() or ())
        structlog.contextvars.bind_contextvars(tenant=identity.tenant, key_id=identity.key_id)
        scopes.require("Batches", identity.scopes, identity.key_id)
        return identity

    @_store_errors
    async def CreateFile(self, request: pb.CreateFileRequest, context: grpc.aio.ServicerContext) -> pb.FileObject:
        identity = await self._identify(context)
        if request.purpose != PURPOSE:
            raise InvalidArgument(
                f"purpose {request.purpose[:32]!r} is not supported; upload files with purpose 'batch'"
            )
        limit = self._settings.batch_max_file_bytes
        if len(request.content) > limit:
            raise InvalidArgument(f"the file is {len(request.content)} bytes, above the limit of {limit}; split it")
        if not request.content:
            raise InvalidArgument("the file is empty; upload JSONL, one request per line")
        filename = request.filename[:256] or "upload.jsonl"
        policy = self._gate.policy(identity)
        record = await self._files.create(
            identity.tenant, filename, PURPOSE, request.content, limit_bytes=policy.batch_file_bytes
        )
        return file_pb(record)

    @_store_errors
    async def GetFile(self, request: pb.FileRef, context: grpc.aio.ServicerContext) -> pb.FileObject:
        identity = await self._identify(context)
        _check_id("file_id", request.file_id)
        return file_pb(await self._files.get(identity.tenant, request.file_id))

    @_store_errors
    async def ListFiles(self, request: pb.ListFilesRequest, context: grpc.aio.ServicerContext) -> pb.ListFilesResponse:
        identity = await self._identify(context)
        if request.after:
            _check_id("after", request.after)
        limit = min(request.limit or 10_000, 10_000)
        files, more = await self._files.page(identity.tenant, purpose=request.purpose, limit=limit, after=request.after)
        return pb.ListFilesResponse(files=[file_pb(f) for f in files], has_more=more)

    async def GetFileContent(
        self, request: pb.FileRef, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.FileContent]:
        identity = await self._identify(context)
        _check_id("file_id", request.file_id)
        try:
            async for piece in self._files.pieces(identity.tenant, request.file_id, PIECE_BYTES):
                yield pb.FileContent(content=piece)
        except (RedisError, OSError) as exc:  # as _store_errors, for a stream
            structlog.get_logger(__name__).warning("batch_store_unavailable", error=type(exc).__name__)
            raise Unavailable(STORE_OUTAGE) from None

    @_store_errors
    async def DeleteFile(self, request: pb.FileRef, context: grpc.aio.ServicerContext) -> pb.DeleteFileResponse:
        identity = await self._identify(context)
        _check_id("file_id", request.file_id)
        await self._files.delete(identity.tenant, request.file_id)
        return pb.DeleteFileResponse(id=request.file_id, deleted=True)

    @_store_errors
    async def CreateBatch(self, request: pb.CreateBatchRequest, context: grpc.aio.ServicerContext) -> pb.BatchObject:
        identity = await self._identify(context)
        _check_id("input_file_id", request.input_file_id)
        window = request.completion_window or "24h"
        window_s = window_seconds(window, self._settings.batch_max_window_s)
        if len(request.metadata) > MAX_METADATA:
            raise InvalidArgument(f"metadata has {len(request.metadata)} pairs; send at most {MAX_METADATA}")
        for key, value in request.metadata.items():
            if len(key) > 64 or len(value) > 512:
                raise InvalidArgument("metadata keys may have 64 characters and values 512; shorten them")
        data = await self._files.content(identity.tenant, request.input_file_id)
        lines = parse_input(data, request.endpoint, max_lines=self._settings.batch_max_lines)
        if identity.models:  # the runner calls with its own credential: the key's model limit is checked here
            for number, line in enumerate(lines, 1):
                model = json.loads(line.raw)["body"].get("model")
                try:
                    scopes.require_model(model if isinstance(model, str) else "", identity.models, identity.key_id)
                except PermissionDenied as exc:
                    raise PermissionDenied(f"request {number} ({line.custom_id[:64]!r}): {exc.message}") from None
        policy = self._gate.policy(identity)
        record = await self._store.create(
            identity.tenant,
            input_file_id=request.input_file_id,
            endpoint=request.endpoint,
            completion_window=window,
            window_s=window_s,
            metadata=dict(request.metadata),
            lines=lines,
            lines_limit=policy.batch_lines_in_flight,
        )
        structlog.get_logger(__name__).info("batch_created", batch_id=record.id, lines=record.total)
        return batch_pb(record)

    @_store_errors
    async def GetBatch(self, request: pb.BatchRef, context: grpc.aio.ServicerContext) -> pb.BatchObject:
        identity = await self._identify(context)
        _check_id("batch_id", request.batch_id)
        return batch_pb(await self._store.get(identity.tenant, request.batch_id))

    @_store_errors
    async def ListBatches(
        self, request: pb.ListBatchesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListBatchesResponse:
        identity = await self._identify(context)
        if request.after:
            _check_id("after", request.after)
        if request.limit > 100:
            raise InvalidArgument(f"limit must be 1 to 100 (got {request.limit})")
        batches, more = await self._store.page(identity.tenant, limit=request.limit or 20, after=request.after)
        return pb.ListBatchesResponse(batches=[batch_pb(b) for b in batches], has_more=more)

    @_store_errors
    async def CancelBatch(self, request: pb.BatchRef, context: grpc.aio.ServicerContext) -> pb.BatchObject:
        identity = await self._identify(context)
        _check_id("batch_id", request.batch_id)
        return batch_pb(await self._store.cancel(identity.tenant, request.batch_id))
