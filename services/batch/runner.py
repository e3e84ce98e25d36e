"""The runner loop: take a line from the work stream, wait until :class:`Capacity` allows, run it through a
router's ``meshserve.v1.Inference`` (internal credential, the batch's tenant, priority 0), write its
result once, acknowledge the entry.

Crash safety (services/store/batches.py has the store's side): an entry is acknowledged only after
its result is written, so a runner killed at any point leaves its lines pending in the group, and
another runner (or this one restarted) takes them over after ``claim_idle_s``; a line run twice
writes one result. A line that fails with a passing error (no worker up, overloaded, deadline) is
queued again after a pause (UNAVAILABLE and RESOURCE_EXHAUSTED, the mesh's state, without limit;
the others up to ``max_attempts`` runs); any other error is the line's answer (error file).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import Sequence
from typing import Any

import grpc
import structlog
from prometheus_client import Counter, Gauge
from redis.exceptions import RedisError

from services.batch import lines
from services.batch.capacity import Capacity
from services.batch.config import BatchSettings
from services.common import metadata as md
from services.common.errors import InvalidArgument, MeshError
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.gateway.http import openai_reply
from services.gateway.validation import Limits
from services.store.batches import BatchStore, WorkItem

log = structlog.get_logger(__name__)

LINES = Counter("meshserve_batch_lines_total", "Batch lines finished by this runner, by outcome.", ["outcome"])
IN_FLIGHT = Gauge("meshserve_batch_lines_in_flight", "Batch lines this runner is running now.")
PASSING = frozenset({"UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "CANCELLED", "INTERNAL"})
"""Statuses after which a line is run again (up to ``max_attempts``; UNAVAILABLE and RESOURCE_EXHAUSTED
without limit)."""
RETRY_PAUSE_S = 1.0
"""Pause (holding the line's capacity slot) before a failed line is queued again: a mesh that is down
is not asked again at once, and the lines behind wait with it."""


class Runner:
    """One batch runner (see the module docstring)."""

    def __init__(
        self,
        settings: BatchSettings,
        store: BatchStore,
        routers: Sequence[inference_pb2_grpc.InferenceStub],
        capacity: Capacity,
    ) -> None:
        self._settings = settings
        self._store = store
        self._routers = routers
        self._capacity = capacity
        self._next_router = 0
        self.consumer = settings.consumer or f"{socket.gethostname()}-{os.getpid()}"
        self._limits = Limits(max_prompt_chars=settings.max_prompt_chars, max_tokens=settings.max_tokens_limit)
        self._running: dict[str, WorkItem] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._model = ""
        self._claim_cursor = "0-0"
        self._stopping = asyncio.Event()

    async def run(self) -> None:
        """Take and run lines until :meth:`stop`; then wait for the running ones to end."""
        await self._store.ensure_group()
        helpers = [
            asyncio.create_task(self._capacity.poll_forever()),
            asyncio.create_task(self._every(self._settings.sweep_interval_s, self._sweep)),
            asyncio.create_task(self._every(self._settings.claim_idle_s / 3, self._touch)),
        ]
        log.info("batch_runner_started", consumer=self.consumer)
        try:
            while not self._stopping.is_set():
                try:
                    item = await self._next()
                except (RedisError, OSError) as exc:
                    log.warning("batch_redis_unreachable", error=type(exc).__name__)
                    await asyncio.sleep(1.0)
                    continue
                if item is None:
                    continue
                # Holding the entry while the capacity is busy (touched, so nobody takes it over);
                # stopped meanwhile, it stays pending for another runner.
                self._running[item.entry_id] = item
                if not await self._slot():
                    break
                task = asyncio.create_task(self._run_line(item))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        finally:
            for helper in helpers:
                helper.cancel()
            if self._tasks:
                await asyncio.wait(self._tasks, timeout=self._settings.shutdown_grace_s)
            for task in self._tasks:
                task.cancel()  # its entry stays pending: another runner takes it over

    def stop(self) -> None:
        self._stopping.set()

    async def _slot(self) -> bool:
        """Wait for the capacity to start a line (True), or for :meth:`stop` (False)."""
        acquire = asyncio.ensure_future(self._capacity.acquire())
        stopping = asyncio.ensure_future(self._stopping.wait())
        await asyncio.wait({acquire, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if acquire.done():
            return True
        acquire.cancel()
        return False

    async def _every(self, period_s: float, step: Any) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                await step()
            except (RedisError, OSError) as exc:
                log.warning("batch_redis_unreachable", step=step.__name__, error=type(exc).__name__)
            except Exception:
                log.exception("batch_background_step_failed", step=step.__name__)

    async def _sweep(self) -> None:
        s = self._settings
        await self._store.sweep(
            requeue_after_s=s.requeue_after_s,
            cancel_grace_s=s.cancel_grace_s,
            stuck_after_s=max(s.claim_idle_s, 10.0),
            expired_line=lines.expired_template(),
        )

    async def _touch(self) -> None:
        await self._store.touch(self.consumer, list(self._running.values()))

    async def _next(self) -> WorkItem | None:
        """A line another runner left behind (it died), else a new one (waiting up to a second)."""
        idle_ms = int(self._settings.claim_idle_s * 1000)
        self._claim_cursor, taken = await self._store.reclaim(self.consumer, idle_ms, 1, self._claim_cursor)
        if taken:
            log.info("batch_line_reclaimed", batch_id=taken[0].batch_id, index=taken[0].index)
            return taken[0]
        if self._stopping.is_set():
            return None
        new = await self._store.read(self.consumer, 1, 1000)
        return new[0] if new else None

    async def _run_line(self, item: WorkItem) -> None:
        self._running[item.entry_id] = item
        IN_FLIGHT.inc()
        try:
            await self._line(item)
        except (RedisError, OSError) as exc:  # the entry stays pending and is taken over later
            log.warning("batch_redis_unreachable", batch_id=item.batch_id, index=item.index, error=type(exc).__name__)
        except Exception:
            log.exception("batch_line_failed", batch_id=item.batch_id, index=item.index)
        finally:
            IN_FLIGHT.dec()
            self._running.pop(item.entry_id, None)
            await self._capacity.release()

    async def _line(self, item: WorkItem) -> None:
        status, raw = await self._store.line(item)
        if raw is None or status not in ("validating", "in_progress"):
            await self._store.ack(item)  # cancelled, expired or gone: nothing to run
            LINES.labels("skipped").inc()
            return
        line = json.loads(raw)
        custom_id, url, body = line["custom_id"], line["url"], line["body"]
        request_id = lines.line_id(item.batch_id, item.index)
        structlog.contextvars.bind_contextvars(request_id=request_id, tenant=item.tenant)
        try:
            request = lines.request_for(url, body, self._limits)
            answer = await self._call(item.tenant, request_id, request, body.get("model"))
        except InvalidArgument as exc:
            out, ok = lines.failure(item.batch_id, item.index, custom_id, request_id, exc.code, exc.message), False
        except grpc.aio.AioRpcError as exc:
            code = exc.code().name
            # No worker or router reachable, or the mesh overloaded, is not the line's fault: it waits
            # and runs again, uncounted (the completion window bounds the wait); the other passing
            # errors count against MAX_ATTEMPTS.
            waits = code in ("UNAVAILABLE", "RESOURCE_EXHAUSTED")
            if waits or (code in PASSING and await self._store.count_attempt(item) < self._settings.max_attempts):
                log.warning("batch_line_retried", code=code, detail=exc.details())
                await asyncio.sleep(md.retry_after_ms(exc.trailing_metadata()) / 1000 if waits else RETRY_PAUSE_S)
                await self._store.requeue(item)
                LINES.labels("retried").inc()
                return
            message = exc.details() or "the request failed"
            out, ok = lines.failure(item.batch_id, item.index, custom_id, request_id, code, message), False
        except MeshError as exc:
            out, ok = lines.failure(item.batch_id, item.index, custom_id, request_id, exc.code, exc.message), False
        else:
            out, ok = lines.success(item.batch_id, item.index, custom_id, request_id, answer), True
        outcome = await self._store.record(item, custom_id, ok, out)
        LINES.labels("ok" if ok else "failed").inc()
        if outcome == "last":
            batch = await self._store.finalize(item.tenant, item.batch_id)
            log.info(
                "batch_done",
                batch_id=item.batch_id,
                status=batch.status,
                completed=batch.completed,
                failed=batch.failed,
            )
        await self._store.ack(item)

    def _router(self) -> inference_pb2_grpc.InferenceStub:
        self._next_router = (self._next_router + 1) % len(self._routers)
        return self._routers[self._next_router]

    async def _call(
        self, tenant: str, request_id: str, request: pb.ChatRequest | pb.GenerateRequest, model: Any
    ) -> dict[str, Any]:
        """Run the request on a router; the response body the HTTP API would have returned."""
        metadata = (
            (md.REQUEST_ID, request_id),
            (md.TENANT, tenant),
            (md.INTERNAL_TOKEN, self._settings.internal_token),
        )
        router = self._router()
        served = model if isinstance(model, str) and model else await self._served_model(router, metadata)
        timeout = self._settings.line_timeout_s
        with self._capacity.call():  # the routers' turns less these are the interactive ones
            if isinstance(request, pb.GenerateRequest):
                reply = await router.Complete(request, metadata=metadata, timeout=timeout)
                return openai_reply.completion(request_id, served, reply.text, reply.final)
            call = router.Chat(metadata=metadata, timeout=timeout)
            try:
                await call.write(request)
                await call.done_writing()
                parts: list[str] = []
                async for frame in call:
                    parts.append(frame.text)
                    if frame.HasField("final"):
                        return openai_reply.chat_completion(request_id, served, "".join(parts), frame.final)
            finally:
                call.cancel()
        raise MeshError("the chat stream ended without a final frame")

    async def _served_model(self, router: inference_pb2_grpc.InferenceStub, metadata: Any) -> str:
        if not self._model:
            reply = await router.ListModels(pb.ListModelsRequest(), metadata=metadata, timeout=10.0)
            self._model = reply.models[0].id if reply.models else ""
        return self._model
