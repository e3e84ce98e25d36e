"""The worker's load report: what ``Worker.Stats`` answers and every heartbeat pushes to the router.

Engine-agnostic. Load (active, queued, slots) comes from admission, lifetime counters from
:class:`~services.worker.stats.WorkerCounters`, and the KV view from the engine where it
knows one (``kv_usage()``, ``hot_prefix_blocks()``, see ``types.py``), else from what the runtime
itself knows:

* ``model_state`` and ``resident_bytes``: where the model is (services/worker/sleep.py) and the
  process's resident memory;
* ``kv_tokens``: context tokens of the sequences running now plus those of chats kept between turns;
* ``hot_prefix_blocks``: block hashes (``services.store.keys.kv_block_hashes``, the scheme of the KV
  prefix cache, salted with each request's tenant unless shareable) of the engine's prefix cache
  first, then of the running sequences and the kept chats, most recent first, deduplicated, and cut
  at ``max_hot_blocks`` (1024 by default: 32 KiB a report). A chain is listed from its first
  block, so a cut keeps leading blocks.

Kept chats only serve their own next turn on engines without a cross-request prefix cache (the
edge engine), so their blocks tell the router where a chat's context lives rather than promise reuse
to other requests; engines with a prefix cache report that cache and it comes first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import structlog

from services.common.generation import GenerationRequest
from services.common.model_state import ModelState
from services.store.keys import kv_block_hashes
from services.worker.runner import Runner
from services.worker.sessions import HeldPrefix
from services.worker.stats import CounterSnapshot
from services.worker.types import KVUsage

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class LoadReport:
    """A worker's load and KV view at one moment (transport-free; the servicer converts it)."""

    active_sequences: int
    queue_depth: int
    max_active_sequences: int
    counters: CounterSnapshot
    kv_used_bytes: int
    kv_budget_bytes: int
    kv_tokens: int
    held_sequences: int
    prefix_block_tokens: int
    hot_prefix_blocks: tuple[bytes, ...]
    model_version: str
    model_state: ModelState = ModelState.AWAKE
    """Where the model is (services/worker/sleep.py)."""
    resident_bytes: int = 0
    """The process's resident memory (0: not measured)."""


@dataclass(frozen=True)
class PrefixHasher:
    """KV block hashes of one model version at one block size (the cache's scheme)."""

    model_id: str
    model_version: str
    block_tokens: int

    def __call__(self, token_ids: Sequence[int], tenant: str, shareable: bool, limit: int | None = None) -> list[bytes]:
        return kv_block_hashes(
            model_id=self.model_id,
            model_version=self.model_version,
            tenant=tenant,
            token_ids=token_ids,
            block_tokens=self.block_tokens,
            shareable=shareable,
            limit=limit,
        )


class LoadReporter:
    """Builds :class:`LoadReport` s for a runner (engine calls and hashing run in a thread)."""

    def __init__(self, runner: Runner, hasher: PrefixHasher, *, max_hot_blocks: int = 1024) -> None:
        self.runner = runner
        self.hasher = hasher
        self.max_hot_blocks = max_hot_blocks
        self._warned: set[str] = set()

    async def report(self) -> LoadReport:
        """The current report; never raises for a misbehaving engine hook (it is logged once)."""
        runner = self.runner  # what the event loop owns is read here, the rest in a thread
        admission = runner.admission
        running = [t.request for t in runner.running]
        held = runner.sessions.held_prefixes()
        load = (admission.active, admission.queued, admission.max_active)
        state = runner.model.state
        report = await asyncio.to_thread(self.build, running, held, load, runner.counters.snapshot())
        return replace(report, model_state=state)

    def build(
        self,
        running_requests: Sequence[GenerationRequest],
        held: Sequence[HeldPrefix],
        load: tuple[int, int, int],
        counters: CounterSnapshot,
    ) -> LoadReport:
        """The blocking part of :meth:`report` (call from a thread): engine hooks and hashing."""
        running = [HeldPrefix(r.context, r.tenant, r.shareable) for r in running_requests]
        usage = self._engine_kv_usage()
        return LoadReport(
            active_sequences=load[0],
            queue_depth=load[1],
            max_active_sequences=load[2],
            counters=counters,
            kv_used_bytes=usage.used_bytes if usage else 0,
            kv_budget_bytes=usage.budget_bytes if usage else 0,
            kv_tokens=sum(len(p.token_ids) for p in (*running, *held)),
            held_sequences=len(held),
            prefix_block_tokens=self.hasher.block_tokens,
            hot_prefix_blocks=self._hot_blocks([*reversed(running), *held]),
            model_version=self.hasher.model_version,
            resident_bytes=self.runner.model.memory.resident_bytes(),
        )

    def _engine_kv_usage(self) -> KVUsage | None:
        try:
            usage = self.runner.engine.kv_usage()
        except Exception:  # a report without KV usage beats no report
            self._warn_once("kv_usage")
            return None
        return usage if isinstance(usage, KVUsage) else None

    def _hot_blocks(self, prefixes: Iterable[HeldPrefix]) -> tuple[bytes, ...]:
        limit = self.max_hot_blocks
        out: dict[bytes, None] = {}
        try:
            for block in self.runner.engine.hot_prefix_blocks(self.hasher.block_tokens):
                if len(out) >= limit:
                    break
                out.setdefault(bytes(block), None)
        except Exception:
            self._warn_once("hot_prefix_blocks")
        for p in prefixes:
            if len(out) >= limit:
                break
            for block in self.hasher(p.token_ids, p.tenant, p.shareable, limit=limit):
                out.setdefault(block, None)
                if len(out) >= limit:
                    break
        return tuple(out)

    def _warn_once(self, hook: str) -> None:
        if hook not in self._warned:
            self._warned.add(hook)
            log.exception("engine_report_hook_failed", hook=hook)
