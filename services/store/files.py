"""Files of the Files API (batch inputs, and the output and error files batches write), per tenant.

Layout under the tenant's prefix (:func:`services.store.keys.batch_tenant_prefix`): ``f:<id>`` a
hash of the file's metadata, ``fd:<id>`` its bytes, ``files`` a sorted set of the tenant's file ids
by creation time, ``bytes`` the bytes the tenant stores (its quota). One script creates a file and
charges the quota, so two uploads at once cannot both pass a limit that only one fits under.
A tenant reaches only keys under its own prefix: another tenant's file id is simply not found.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from services.common.errors import NotFound, ResourceExhausted
from services.store.connection import AnyRedis
from services.store.keys import batch_tenant_prefix

_CREATE = """
local size = tonumber(ARGV[2])
local limit = tonumber(ARGV[3])
local used = tonumber(redis.call('GET', KEYS[4]) or '0')
local old = tonumber(redis.call('HGET', KEYS[1], 'bytes') or '0')
if limit > 0 and used - old + size > limit then return used end
redis.call('INCRBY', KEYS[4], size - old)
redis.call('SET', KEYS[2], ARGV[6])
redis.call('HSET', KEYS[1], 'bytes', size, 'created_at', ARGV[1], 'filename', ARGV[4], 'purpose', ARGV[5])
redis.call('ZADD', KEYS[3], ARGV[1], ARGV[7])
return -1
"""
_DELETE = """
local size = redis.call('HGET', KEYS[1], 'bytes')
if not size then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('DECRBY', KEYS[4], size)
return 1
"""


@dataclass(frozen=True)
class FileRecord:
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str


def new_file_id() -> str:
    return "file-" + uuid.uuid4().hex[:24]


class FileStore:
    """The Files API's state in Redis (see the module docstring)."""

    def __init__(self, redis: AnyRedis) -> None:
        self._redis: Any = redis  # redis-py's reply types are unions of everything a command may return
        self._create = redis.register_script(_CREATE)
        self._delete = redis.register_script(_DELETE)

    @staticmethod
    def _keys(tenant: str, file_id: str) -> list[str]:
        p = batch_tenant_prefix(tenant)
        return [f"{p}:f:{file_id}", f"{p}:fd:{file_id}", f"{p}:files", f"{p}:bytes"]

    async def create(
        self,
        tenant: str,
        filename: str,
        purpose: str,
        content: bytes,
        *,
        limit_bytes: int = 0,
        file_id: str = "",
    ) -> FileRecord:
        """Store ``content`` as a new file of ``tenant``; ``limit_bytes`` (0 = none) bounds what the
        tenant stores in all, else :class:`ResourceExhausted`. ``file_id`` names it (a batch's
        output files have ids derived from the batch: writing one twice replaces it, charged once)."""
        file_id = file_id or new_file_id()
        now = int(time.time())
        keys = self._keys(tenant, file_id)
        used = await self._create(keys=keys, args=[now, len(content), limit_bytes, filename, purpose, content, file_id])
        if int(used) >= 0:
            raise ResourceExhausted(
                f"tenant storage quota reached: {int(used)} bytes stored, this file is {len(content)} and the limit"
                f" is {limit_bytes}; delete files you no longer need",
                retry_after_ms=60_000,
            )
        return FileRecord(file_id, len(content), now, filename, purpose)

    async def get(self, tenant: str, file_id: str) -> FileRecord:
        fields = await self._redis.hmget(self._keys(tenant, file_id)[0], "bytes", "created_at", "filename", "purpose")
        if fields[0] is None:
            raise NotFound(f"no file with id {file_id!r}; GET /v1/files lists your files")
        size, created, filename, purpose = fields
        return FileRecord(file_id, int(size), int(created), _text(filename), _text(purpose))

    async def content(self, tenant: str, file_id: str) -> bytes:
        data = await self._redis.get(self._keys(tenant, file_id)[1])
        if data is None:
            raise NotFound(f"no file with id {file_id!r}; GET /v1/files lists your files")
        return bytes(data)

    async def pieces(self, tenant: str, file_id: str, size: int) -> AsyncIterator[bytes]:
        """The file's bytes, ``size`` at a time (GETRANGE: a large file is never one reply)."""
        record = await self.get(tenant, file_id)
        key = self._keys(tenant, file_id)[1]
        for start in range(0, record.bytes, size):
            yield bytes(await self._redis.getrange(key, start, min(start + size, record.bytes) - 1))

    async def delete(self, tenant: str, file_id: str) -> None:
        if not int(await self._delete(keys=self._keys(tenant, file_id), args=[file_id])):
            raise NotFound(f"no file with id {file_id!r}; GET /v1/files lists your files")

    async def page(
        self, tenant: str, *, purpose: str = "", limit: int = 10_000, after: str = ""
    ) -> tuple[list[FileRecord], bool]:
        """The tenant's files, newest first, after the file ``after`` (a page); and whether more follow."""
        index = self._keys(tenant, "")[2]
        start = 0
        if after:
            rank = await self._redis.zrevrank(index, after)
            if rank is None:
                raise NotFound(f"no file with id {after!r} to list after; pass an id from the previous page")
            start = int(rank) + 1
        ids = [_text(i) for i in await self._redis.zrevrange(index, start, -1)]
        out: list[FileRecord] = []
        for file_id in ids:
            try:
                record = await self.get(tenant, file_id)
            except NotFound:
                continue
            if purpose and record.purpose != purpose:
                continue
            if len(out) == limit:
                return out, True
            out.append(record)
        return out, False

    async def used_bytes(self, tenant: str) -> int:
        return int(await self._redis.get(self._keys(tenant, "")[3]) or 0)


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value
