"""Batches of the Batch API in Redis: the batch records, their lines, the work stream and the results.

Per tenant (under :func:`services.store.keys.batch_tenant_prefix`, one slot): ``b:<id>`` the batch's
record (a hash: status, timestamps, counts), ``b:<id>:in`` its input lines by index, ``b:<id>:out``
and ``b:<id>:err`` its results by ``custom_id`` (a line that succeeded, a line that failed),
``b:<id>:tries`` attempts per line, ``batches`` the tenant's batch ids by creation time and ``lines``
the lines of its live batches (the lines-in-flight quota).

The work: one stream (:data:`~services.store.keys.BATCH_WORK_STREAM`) of ``(tenant, batch, line)``
entries read by every batch runner through the consumer group ``runners``; an entry is acknowledged
(and deleted) once its line's result is written. Delivery is at least once: an entry held by a runner
that died is claimed by another after an idle time (XAUTOCLAIM), and a batch whose creator died
before every line was queued is queued again by a runner's sweep. Results are written exactly once:
one script writes a line's result only if its ``custom_id`` has none yet and counts it in the same
step, so a line run twice leaves one result and one count. The output and error files are built
from the result hashes once the last result is in (or the batch expired, or was cancelled), and
their ids are derived from the batch's, so building them twice writes the same files.

Status flow (OpenAI's): ``validating`` -> ``in_progress`` -> ``finalizing`` -> ``completed``;
``expired`` when the completion window ends first; ``cancelling`` -> ``cancelled`` on request.
Results are accepted while ``validating``, ``in_progress`` or ``cancelling``; the switch to
``finalizing`` closes the batch to writes, so the files hold every counted result.

This module also owns the batch input format (OpenAI's JSONL, one request per line): see
:func:`parse_input`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog
from redis.exceptions import ResponseError

from services.common.errors import InvalidArgument, NotFound, ResourceExhausted
from services.store.connection import AnyRedis
from services.store.files import FileStore
from services.store.keys import BATCH_ACTIVE, BATCH_WORK_STREAM, batch_tenant_prefix

log = structlog.get_logger(__name__)

GROUP = "runners"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
OPEN = ("validating", "in_progress", "cancelling")
"""States in which results are accepted."""
TERMINAL = ("completed", "expired", "cancelled", "failed")
TIMES = (
    "created_at",
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)
"""A batch's timestamp fields, by OpenAI's names (the HTTP adapter's batch object lists the same)."""
MAX_CUSTOM_ID_CHARS = 512

_CREATE = """
local total = tonumber(ARGV[1])
local limit = tonumber(ARGV[2])
local used = tonumber(redis.call('GET', KEYS[3]) or '0')
if limit > 0 and used + total > limit then return used end
redis.call('INCRBY', KEYS[3], total)
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[4])
return -1
"""
_RECORD = """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 or redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then return 1 end
local st = redis.call('HGET', KEYS[1], 'status')
if st ~= 'validating' and st ~= 'in_progress' and st ~= 'cancelling' then return 0 end
local target, counter, other = KEYS[2], 'completed', 'failed'
if ARGV[2] == '0' then target, counter, other = KEYS[3], 'failed', 'completed' end
redis.call('HSET', target, ARGV[1], ARGV[3])
local done = redis.call('HINCRBY', KEYS[1], counter, 1) + tonumber(redis.call('HGET', KEYS[1], other) or '0')
if done >= tonumber(redis.call('HGET', KEYS[1], 'total')) then
  redis.call('HSET', KEYS[1], 'status', 'finalizing', 'finalizing_at', ARGV[4])
  return 3
end
return 2
"""
_MOVE = """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return false end
for i = 4, #ARGV do if st == ARGV[i] then
  redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[1] .. '_at', ARGV[2])
  if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'ending', ARGV[3]) end
  return 1
end end
return st
"""
_CLOSE = """
if redis.call('HGET', KEYS[1], 'status') ~= 'finalizing' then return 0 end
local ending = redis.call('HGET', KEYS[1], 'ending')
redis.call('HSET', KEYS[1], 'status', ending, ending .. '_at', ARGV[1])
redis.call('HSET', KEYS[1], 'output_file_id', ARGV[2], 'error_file_id', ARGV[3])
local left = redis.call('DECRBY', KEYS[2], redis.call('HGET', KEYS[1], 'total'))
if left < 0 then redis.call('SET', KEYS[2], 0) end
return 1
"""


@dataclass(frozen=True)
class InputLine:
    index: int
    custom_id: str
    raw: str


def parse_input(data: bytes, endpoint: str, *, max_lines: int) -> list[InputLine]:
    """The lines of a batch input file, checked for shape: each a JSON object with a unique string
    ``custom_id``, ``"method": "POST"``, ``url`` equal to the batch's ``endpoint`` and an object
    ``body`` (the body itself is checked when the line runs; a bad one gets an error-file entry).
    Any other problem refuses the whole file with :class:`InvalidArgument` naming the line."""
    if endpoint not in ENDPOINTS:
        raise InvalidArgument(f"endpoint {endpoint[:64]!r} is not supported; use {' or '.join(ENDPOINTS)}")
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise InvalidArgument("the input file is not UTF-8 text; upload JSONL, one request per line") from None
    lines: list[InputLine] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        if len(lines) == max_lines:
            raise InvalidArgument(f"the input file has more than {max_lines} requests; split it into several batches")
        try:
            line = json.loads(raw)
        except (ValueError, RecursionError):
            raise InvalidArgument(
                f"line {number} of the input file is not valid JSON; write one JSON object per line"
            ) from None
        if not isinstance(line, dict):
            raise InvalidArgument(f"line {number} of the input file is not a JSON object")
        custom_id = line.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
            raise InvalidArgument(
                f"line {number}: 'custom_id' must be a non-empty string of at most {MAX_CUSTOM_ID_CHARS} characters"
            )
        if custom_id in seen:
            raise InvalidArgument(f"line {number}: custom_id {custom_id[:64]!r} is used twice; make each one unique")
        seen.add(custom_id)
        if line.get("method") != "POST":
            raise InvalidArgument(f"line {number}: 'method' must be \"POST\"")
        if line.get("url") != endpoint:
            raise InvalidArgument(f"line {number}: 'url' must be the batch's endpoint {endpoint!r}")
        if not isinstance(line.get("body"), dict):
            raise InvalidArgument(f"line {number}: 'body' must be a JSON object (the request)")
        lines.append(InputLine(len(lines), custom_id, raw))
    if not lines:
        raise InvalidArgument("the input file has no requests; write one JSON request per line")
    return lines


def window_seconds(window: str, max_s: int) -> int:
    """A completion window (``"24h"``, ``"90m"``, ``"30s"``) in seconds, at most ``max_s``."""
    unit = {"h": 3600, "m": 60, "s": 1}.get(window[-1:])
    if unit is None or not window[:-1].isdigit() or int(window[:-1]) == 0:
        raise InvalidArgument(f'completion_window {window[:16]!r} must look like "24h", "90m" or "30s"')
    seconds = int(window[:-1]) * unit
    if seconds > max_s:
        raise InvalidArgument(f'completion_window {window!r} is longer than the limit of {max_s} s; use "24h" or less')
    return seconds


@dataclass(frozen=True)
class BatchRecord:
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str = ""
    error_file_id: str = ""
    times: Mapping[str, int] = field(default_factory=dict)
    total: int = 0
    completed: int = 0
    failed: int = 0
    metadata: Mapping[str, str] = field(default_factory=dict)
    ending: str = "completed"

    @classmethod
    def from_hash(cls, batch_id: str, h: Mapping[bytes, bytes]) -> BatchRecord:
        s = {k.decode(): v.decode() for k, v in h.items()}
        return cls(
            id=batch_id,
            endpoint=s.get("endpoint", ""),
            input_file_id=s.get("input_file_id", ""),
            completion_window=s.get("completion_window", ""),
            status=s.get("status", ""),
            output_file_id=s.get("output_file_id", ""),
            error_file_id=s.get("error_file_id", ""),
            times={t: int(s[t]) for t in TIMES if s.get(t)},
            total=int(s.get("total", 0)),
            completed=int(s.get("completed", 0)),
            failed=int(s.get("failed", 0)),
            metadata=json.loads(s.get("metadata", "{}")),
            ending=s.get("ending", "completed"),
        )


@dataclass(frozen=True)
class WorkItem:
    """One stream entry: line ``index`` of batch ``batch_id`` of ``tenant``."""

    entry_id: str
    tenant: str
    batch_id: str
    index: int


def _item(entry_id: bytes | str, fields: Mapping[bytes, bytes]) -> WorkItem:
    eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return WorkItem(eid, fields[b"t"].decode(), fields[b"b"].decode(), int(fields[b"i"]))


class BatchStore:
    """Batch records, the work stream and results (see the module docstring)."""

    def __init__(self, redis: AnyRedis, files: FileStore | None = None) -> None:
        self._redis: Any = redis  # redis-py's reply types are unions of everything a command may return
        self.files = files or FileStore(redis)
        self._create = redis.register_script(_CREATE)
        self._record = redis.register_script(_RECORD)
        self._move = redis.register_script(_MOVE)
        self._close = redis.register_script(_CLOSE)

    @staticmethod
    def _key(tenant: str, batch_id: str, suffix: str = "") -> str:
        return f"{batch_tenant_prefix(tenant)}:b:{batch_id}{suffix}"

    # --- the Batch API -------------------------------------------------------------------------

    async def create(
        self,
        tenant: str,
        *,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        window_s: int,
        metadata: Mapping[str, str],
        lines: list[InputLine],
        lines_limit: int = 0,
    ) -> BatchRecord:
        """Record a batch of ``lines`` and queue them; ``lines_limit`` (0 = none) bounds the lines of
        the tenant's live batches, else :class:`ResourceExhausted`."""
        batch_id = "batch_" + uuid.uuid4().hex[:24]
        now = int(time.time())
        key = self._key(tenant, batch_id)
        for start in range(0, len(lines), 1000):
            chunk = lines[start : start + 1000]
            await self._redis.hset(key + ":in", mapping={str(line.index): line.raw for line in chunk})
        fields = {
            "endpoint": endpoint,
            "input_file_id": input_file_id,
            "completion_window": completion_window,
            "status": "validating",
            "ending": "completed",
            "created_at": now,
            "expires_at": now + window_s,
            "total": len(lines),
            "completed": 0,
            "failed": 0,
            "metadata": json.dumps(dict(metadata)),
        }
        flat: list[Any] = [x for kv in fields.items() for x in kv]
        prefix = batch_tenant_prefix(tenant)
        used = await self._create(
            keys=[key, f"{prefix}:batches", f"{prefix}:lines"], args=[len(lines), lines_limit, now, batch_id, *flat]
        )
        if int(used) >= 0:
            await self._redis.delete(key + ":in")
            raise ResourceExhausted(
                f"batch quota reached: {int(used)} lines of your batches are in flight, this batch has {len(lines)}"
                f" and the limit is {lines_limit}; wait for a batch to finish or cancel one",
                retry_after_ms=60_000,
            )
        await self._redis.zadd(BATCH_ACTIVE, {f"{tenant}\t{batch_id}": now})
        await self._enqueue(tenant, batch_id, [line.index for line in lines])
        await self._move(keys=[key], args=["in_progress", now, "", "validating"])
        return await self.get(tenant, batch_id)

    async def _enqueue(self, tenant: str, batch_id: str, indexes: Iterable[int]) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for n, index in enumerate(indexes, 1):
            pipe.xadd(BATCH_WORK_STREAM, {"t": tenant, "b": batch_id, "i": index})
            if n % 1000 == 0:
                await pipe.execute()
        await pipe.execute()

    async def get(self, tenant: str, batch_id: str) -> BatchRecord:
        h = await self._redis.hgetall(self._key(tenant, batch_id))
        if not h:
            raise NotFound(f"no batch with id {batch_id!r}; GET /v1/batches lists your batches")
        return BatchRecord.from_hash(batch_id, h)

    async def page(self, tenant: str, *, limit: int = 20, after: str = "") -> tuple[list[BatchRecord], bool]:
        """The tenant's batches, newest first, after the batch ``after``; and whether more follow."""
        index = f"{batch_tenant_prefix(tenant)}:batches"
        start = 0
        if after:
            rank = await self._redis.zrevrank(index, after)
            if rank is None:
                raise NotFound(f"no batch with id {after!r} to list after; pass an id from the previous page")
            start = int(rank) + 1
        ids = await self._redis.zrevrange(index, start, start + limit)
        out = []
        for raw in ids[:limit]:
            try:
                out.append(await self.get(tenant, raw.decode()))
            except NotFound:
                continue
        return out, len(ids) > limit

    async def cancel(self, tenant: str, batch_id: str) -> BatchRecord:
        """Ask to cancel: lines not yet started are skipped; after the runners' grace time the batch is
        ``cancelled`` with the results it has. Cancelling a cancelling or cancelled batch changes nothing."""
        key = self._key(tenant, batch_id)
        moved = await self._move(
            keys=[key], args=["cancelling", int(time.time()), "cancelled", "validating", "in_progress"]
        )
        if moved is None:
            raise NotFound(f"no batch with id {batch_id!r}; GET /v1/batches lists your batches")
        if moved != 1 and moved not in (b"cancelling", b"cancelled"):
            raise InvalidArgument(
                f"batch {batch_id} is {moved.decode()}; only a validating or in_progress batch can be cancelled"
            )
        return await self.get(tenant, batch_id)

    # --- the runners' side ---------------------------------------------------------------------

    async def ensure_group(self) -> None:
        try:
            await self._redis.xgroup_create(BATCH_WORK_STREAM, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read(self, consumer: str, count: int, block_ms: int) -> list[WorkItem]:
        """New entries for ``consumer`` (waits up to ``block_ms`` for one)."""
        try:
            reply = await self._redis.xreadgroup(GROUP, consumer, {BATCH_WORK_STREAM: ">"}, count=count, block=block_ms)
        except ResponseError as exc:
            if not await self._regrouped(exc):
                raise
            return []
        return [_item(eid, f) for _stream, entries in reply or () for eid, f in entries if f]

    async def _regrouped(self, exc: ResponseError) -> bool:
        """The work stream (and its group) is gone: Redis restarted without persistence, or was flushed.
        Create them again, so runners take new lines at once (the lost entries' batches are lost with
        them and expire); False for any other error."""
        if "NOGROUP" not in str(exc):
            return False
        log.info("batch_work_group_recreated")
        await self.ensure_group()
        return True

    async def reclaim(
        self, consumer: str, min_idle_ms: int, count: int, cursor: str = "0-0"
    ) -> tuple[str, list[WorkItem]]:
        """Entries another consumer has held for ``min_idle_ms`` without acknowledging (it died), from
        ``cursor`` on in the pending list; returns where the next call goes on (``0-0``: the start
        again: XAUTOCLAIM looks at a few entries per call, so a scan that always began at the start
        would never reach a dead runner's entries behind many live ones)."""
        try:
            reply = await self._redis.xautoclaim(BATCH_WORK_STREAM, GROUP, consumer, min_idle_ms, cursor, count=count)
        except ResponseError as exc:
            if not await self._regrouped(exc):
                raise
            return "0-0", []
        following = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
        return following, [_item(eid, f) for eid, f in reply[1] if f]

    async def touch(self, consumer: str, items: Iterable[WorkItem]) -> None:
        """Reset the idle time of entries still running here, so nobody reclaims them."""
        ids = [i.entry_id for i in items]
        if ids:
            await self._redis.xclaim(BATCH_WORK_STREAM, GROUP, consumer, 0, ids, justid=True)

    async def ack(self, item: WorkItem) -> None:
        pipe = self._redis.pipeline(transaction=False)
        pipe.xack(BATCH_WORK_STREAM, GROUP, item.entry_id)
        pipe.xdel(BATCH_WORK_STREAM, item.entry_id)
        await pipe.execute()

    async def count_attempt(self, item: WorkItem) -> int:
        """Count one failed run of the line; returns its failed runs so far."""
        return int(await self._redis.hincrby(self._key(item.tenant, item.batch_id, ":tries"), str(item.index), 1))

    async def requeue(self, item: WorkItem) -> None:
        """Queue the line again (at the stream's end) and drop this entry."""
        await self._enqueue(item.tenant, item.batch_id, [item.index])
        await self.ack(item)

    async def line(self, item: WorkItem) -> tuple[str, str | None]:
        """(the batch's status, the line's raw JSON); ("", None) when the batch is gone."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.hget(self._key(item.tenant, item.batch_id), "status")
        pipe.hget(self._key(item.tenant, item.batch_id, ":in"), str(item.index))
        status, raw = await pipe.execute()
        return (status.decode() if status else ""), (raw.decode() if raw else None)

    async def record(self, item: WorkItem, custom_id: str, ok: bool, output_line: str) -> str:
        """Write a line's result once: ``closed`` (the batch takes no more), ``duplicate`` (it has one),
        ``written``, or ``last`` (written, and the batch is complete: call :meth:`finalize`)."""
        k = self._key(item.tenant, item.batch_id)
        code = await self._record(
            keys=[k, k + ":out", k + ":err"], args=[custom_id, 1 if ok else 0, output_line, int(time.time())]
        )
        return ("closed", "duplicate", "written", "last")[int(code)]

    async def finalize(self, tenant: str, batch_id: str, *, expired_line: str = "") -> BatchRecord:
        """Write the output and error files of a ``finalizing`` batch and move it to its final state.

        ``expired_line``: for an expired batch, a template of the error line of each unfinished
        request (``{custom_id}`` and ``{id}`` are filled in).
        """
        key = self._key(tenant, batch_id)
        batch = await self.get(tenant, batch_id)
        if batch.status != "finalizing":
            return batch
        inputs = await self._redis.hgetall(key + ":in")
        out = await self._redis.hgetall(key + ":out")
        err = await self._redis.hgetall(key + ":err")
        ok_lines, bad_lines = [], []
        for index in sorted(int(i) for i in inputs):
            custom_id = json.loads(inputs[str(index).encode()])["custom_id"]
            cid = custom_id.encode()
            if cid in out:
                ok_lines.append(out[cid])
            elif cid in err:
                bad_lines.append(err[cid])
            elif batch.ending == "expired" and expired_line:
                bad_lines.append(
                    expired_line.replace("{custom_id}", json.dumps(custom_id)[1:-1])
                    .replace("{id}", f"batch_req_{batch_id[6:]}_{index}")
                    .encode()
                )
        output_id = error_id = ""
        if ok_lines:
            output_id = f"file-{batch_id[6:]}-output"
            await self.files.create(
                tenant, f"{batch_id}_output.jsonl", "batch_output", b"\n".join(ok_lines) + b"\n", file_id=output_id
            )
        if bad_lines:
            error_id = f"file-{batch_id[6:]}-errors"
            await self.files.create(
                tenant, f"{batch_id}_errors.jsonl", "batch_output", b"\n".join(bad_lines) + b"\n", file_id=error_id
            )
        await self._close(
            keys=[key, f"{batch_tenant_prefix(tenant)}:lines"], args=[int(time.time()), output_id, error_id]
        )
        await self._redis.zrem(BATCH_ACTIVE, f"{tenant}\t{batch_id}")
        return await self.get(tenant, batch_id)

    async def sweep(
        self, *, requeue_after_s: float, cancel_grace_s: float, stuck_after_s: float, expired_line: str
    ) -> None:
        """One pass over the live batches (any runner may run it; every step is safe to repeat):
        queue again a batch left ``validating`` by a dead creator, expire a batch past its window,
        close a ``cancelling`` batch after ``cancel_grace_s``, finalize one whose finalizer died."""
        now = time.time()
        for member in await self._redis.zrange(BATCH_ACTIVE, 0, -1):
            tenant, _, batch_id = member.decode().partition("\t")
            key = self._key(tenant, batch_id)
            try:
                batch = await self.get(tenant, batch_id)
            except NotFound:
                await self._redis.zrem(BATCH_ACTIVE, member)
                continue
            t = batch.times
            if batch.status in TERMINAL:
                await self._redis.zrem(BATCH_ACTIVE, member)
            elif batch.status in ("validating", "in_progress") and now >= t.get("expires_at", now + 1):
                await self._move(keys=[key], args=["finalizing", int(now), "expired", "validating", "in_progress"])
                await self.finalize(tenant, batch_id, expired_line=expired_line)
            elif batch.status == "validating" and now - t.get("created_at", now) >= requeue_after_s:
                done = set(await self._redis.hkeys(key + ":out")) | set(await self._redis.hkeys(key + ":err"))
                inputs = await self._redis.hgetall(key + ":in")
                todo = [int(i) for i, raw in inputs.items() if json.loads(raw)["custom_id"].encode() not in done]
                await self._enqueue(tenant, batch_id, sorted(todo))
                await self._move(keys=[key], args=["in_progress", int(now), "", "validating"])
            elif batch.status == "cancelling" and now - t.get("cancelling_at", now) >= cancel_grace_s:
                await self._move(keys=[key], args=["finalizing", int(now), "", "cancelling"])
                await self.finalize(tenant, batch_id)
            elif batch.status == "finalizing" and now - t.get("finalizing_at", now) >= stuck_after_s:
                await self.finalize(tenant, batch_id, expired_line=expired_line)
