"""Continuous batching: one thread runs packed model steps for every admitted sequence.

Each step (``Scheduler._step``) is planned under the lock, run without it, committed under it:

1. *Admission* between steps: waiting sequences in priority order (higher ``priority`` first, then
   arrival) take their cached prefix blocks (local LRU, plus blocks their runner thread imported
   from Redis) and reserve blocks for the rest of prompt + replay + ``max_tokens``; when the KV
   budget cannot hold the next one, admission stops until blocks are freed (no preemption).
   Blocks a Worker.ImportKV call loaded from Redis (``import_blocks``) are written just before, as
   cached prefix blocks nobody references yet.
2. *Decode first*: every running sequence that needs a token contributes one (so streams never
   stall behind a long prompt), then the remaining per-step token budget (``max_step_tokens``)
   goes to *chunked prefill* of admitted prompts, most urgent first.
3. One ``forward(segments)`` call (the model, or a tensor-parallel wrapper that broadcasts the
   segments to follower ranks); then tokens are sampled per sequence, appended to its output
   queue, and full blocks are named by their chain key so later prompts share them. With a
   ``StaticDecoder`` (graphs.py, setting ``decode_graphs``) a pure decode step runs there instead,
   with fixed shapes (a CUDA graph on a GPU) and sampling on the device; eager steps then sample
   with the same device sampler (device_sampler.py), one call for the whole step.

Forks (n choices of one prompt, ``submit(seq, forks)``): the first choice is admitted with blocks
reserved for all of them; when its prefill's logits are there, each other choice references the
prompt's full blocks (one more reference each: full blocks are never written again), gets a device
copy of the partial last block (the first choice goes on writing its own: copy on write, done at
once), and samples its first token from the same logits with its own parameters; it then decodes as
any running sequence. The prompt is prefilled once.

A sequence decodes ahead of its consumer by at most ``lookahead`` tokens. ``close()`` marks it,
waits for the step in flight (if it is in it) and releases its blocks at once: cancel stops
within one step and frees KV immediately. Resumed streams replay their tokens one decode step each
(see ``Engine.start``). For speculative decoding, a segment may carry the last token plus k draft
tokens with ``all_logits=True``; accepting j of them means keeping ``computed`` at the accepted
length: the KV slots past it are simply overwritten later.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import count

import structlog
import torch
from torch import Tensor

from services.common.errors import ResourceExhausted, Unavailable
from services.common.logprobs import SampledLogprobs
from services.gpu_worker.blocks import BlockManager
from services.gpu_worker.device_sampler import sample_rows_with_logprobs
from services.gpu_worker.graphs import StaticDecoder
from services.gpu_worker.model import KVCache
from services.gpu_worker.plan import Segment
from services.gpu_worker.sampler import Sampler
from services.worker.types import StepInterrupted

log = structlog.get_logger(__name__)
Forward = Callable[[Sequence[Segment]], list[Tensor]]
_arrivals = count()


@dataclass(eq=False)
class SeqState:
    """One sequence as the scheduler sees it. Fields are guarded by the scheduler's lock."""

    tokens: list[int]
    """Prompt, then tokens fed back (replayed or generated); ``tokens[:computed]`` have KV."""
    prompt_len: int
    replay: deque[int]
    sampler: Sampler
    max_new: int
    eos: frozenset[int]
    priority: int = 0
    keys: list[str] = field(default_factory=list)
    """Chain keys of the full blocks of ``tokens`` named so far (empty: prefix caching off)."""
    key_fn: Callable[[Sequence[int]], list[str]] | None = None
    imported: list[Tensor] = field(default_factory=list)
    """Blocks loaded from Redis for the prompt's first blocks (written into the cache on admission)."""
    arrival: int = field(default_factory=lambda: next(_arrivals))
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    named: int = 0
    """Leading blocks registered under their chain keys."""
    generated: int = 0
    out: deque[int] = field(default_factory=deque)
    out_logprobs: deque[SampledLogprobs] = field(default_factory=deque)
    """With logprobs asked for (``sampler.top`` not None): those of ``out``'s tokens, in step."""
    last_logprobs: SampledLogprobs | None = None
    """Those of the token ``Scheduler.next_token`` returned last (the consumer's; logprobs asked for)."""
    admitted: bool = False
    done: bool = False
    closed: bool = False
    released: bool = False
    error: BaseException | None = None
    prefilled: int = 0
    reused_local: int = 0
    reused_redis: int = 0
    wake: threading.Condition | None = field(default=None, repr=False)
    """This sequence's consumer waits here (set by ``Scheduler.submit``; shares the scheduler's lock)."""
    forks: list[SeqState] = field(default_factory=list)
    """The other choices of an n-choice request, made from this sequence when its prefill ends
    (``Scheduler.submit``'s ``forks``); never queued or planned before that."""

    @property
    def reserve(self) -> int:
        return self.prompt_len + len(self.replay) + self.max_new


@dataclass(eq=False)
class ImportJob:
    """Blocks loaded from Redis for the local prefix cache, handed to the scheduler thread."""

    keys: list[str]
    data: list[Tensor]
    imported: int = 0
    done: bool = False
    error: BaseException | None = None


class Scheduler:
    """Runs the batching loop in its own thread (see the module docstring)."""

    def __init__(
        self,
        forward: Forward,
        cache: KVCache,
        blocks: BlockManager,
        *,
        max_step_tokens: int = 512,
        lookahead: int = 2,
        on_step: Callable[[int, int], None] | None = None,
        write_blocks: Callable[[Sequence[int], Sequence[Tensor]], None] | None = None,
        static: StaticDecoder | None = None,
    ) -> None:
        self.forward = forward
        # Pure decode steps run with static shapes (graphs.py); then every token, eager steps'
        # included, is chosen by the device sampler (one sampler per sequence whatever the step).
        self.static = static
        self.cache = cache
        # Writes imported (Redis) blocks into the cache; under TP it scatters head slices to every rank.
        self.write_blocks = write_blocks or self._write_local
        self.blocks = blocks
        self.block_tokens = blocks.block_tokens
        self.max_step_tokens = max_step_tokens
        self.lookahead = lookahead
        self.on_step = on_step
        self.cond = threading.Condition(blocks.lock)
        self.waiting: list[SeqState] = []
        self.running: list[SeqState] = []
        self.in_flight: set[int] = set()
        self.imports: list[ImportJob] = []
        self.steps_total = 0
        self.forks_made = 0
        """Choices made from another sequence's prefill (``submit``'s forks)."""
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="gpu-scheduler", daemon=True)
        self._thread.start()

    def _write_local(self, ids: Sequence[int], data: Sequence[Tensor]) -> None:
        for block, block_data in zip(ids, data, strict=True):
            self.cache.write_block(block, block_data)

    # -- called from sequence threads ---------------------------------------------------------

    def fork_blocks(self, seq: SeqState, n: int) -> int:
        """KV blocks ``n`` choices of ``seq`` hold at most: its own, plus per other choice all but the
        prompt's full blocks (shared)."""
        total = -(-seq.reserve // self.block_tokens)
        return total + (n - 1) * (total - seq.prompt_len // self.block_tokens)

    def submit(self, seq: SeqState, forks: Sequence[SeqState] = ()) -> None:
        """Queue ``seq``; ``forks`` (the other choices, same prompt and budget) are made from it when its
        prefill ends, each with its own consumer condition set here."""
        need = self.fork_blocks(seq, 1 + len(forks))
        if need > self.blocks.num_blocks:
            raise ResourceExhausted(
                f"prompt + max_tokens needs {need} KV blocks but the worker's KV budget holds "
                f"{self.blocks.num_blocks}; lower max_tokens or raise MESHSERVE_GPU_WORKER_KV_BUDGET_BYTES",
                retry_after_ms=0,
            )
        with self.cond:
            seq.wake = threading.Condition(self.blocks.lock)
            for fork in forks:
                if fork.wake is None:
                    fork.wake = threading.Condition(self.blocks.lock)
            seq.forks = [f for f in forks if not f.closed]
            self.waiting.append(seq)
            self.cond.notify_all()

    def import_blocks(self, keys: Sequence[str], data: Sequence[Tensor]) -> int:
        """Cache ``data`` (full-head blocks from Redis) under their chain ``keys`` as unreferenced,
        evictable prefix blocks; returns how many were written. Blocking (call from a worker thread).

        Like imports on admission, the blocks are written by the scheduler thread between two steps
        (``_plan``), so no forward runs while the cache (on every TP rank) is written. Keys cached
        already are skipped; the import stops where the KV budget (free + evictable) has no room.
        """
        job = ImportJob(list(keys), list(data))
        with self.cond:
            self.imports.append(job)
            self.cond.notify_all()
            while not job.done:
                if self._stop:
                    raise Unavailable("the worker is shutting down; import the prefix into another replica")
                self.cond.wait()
        if job.error is not None:
            raise job.error
        return job.imported

    def next_token(self, seq: SeqState) -> int | None:
        """Block until ``seq`` has a token; None when it is finished (EOS or max tokens) or closed.

        Each consumer waits on its own condition (``seq.wake``) and is woken only when its sequence
        changes; ``self.cond`` wakes the scheduler thread and ``close()``. With one shared condition
        every token taken woke every other consumer: O(sequences^2) thread wake-ups per step.
        """
        wake = seq.wake or self.cond
        with self.cond:
            while not seq.out and not seq.done and not seq.closed and seq.error is None:
                wake.wait()
            if seq.error is not None:
                raise seq.error
            if seq.out and not seq.closed:
                token = seq.out.popleft()
                if seq.out_logprobs:
                    seq.last_logprobs = seq.out_logprobs.popleft()
                self.cond.notify_all()  # room in the lookahead window
                return token
            return None

    def interrupt(self, seq: SeqState) -> None:
        """Stop planning ``seq`` and wake its consumer (``next_token`` returns None); unlike ``close``
        it waits for no step in flight, so the event loop may call it. ``close`` frees it later."""
        with self.cond:
            seq.closed = True
            if seq.wake is not None:
                seq.wake.notify_all()
            self.cond.notify_all()

    def close(self, seq: SeqState, before_release: Callable[[SeqState], None] | None = None) -> None:
        """Stop ``seq`` (at the latest after the step in flight) and free its KV blocks now."""
        with self.cond:
            seq.closed = True
            if seq.wake is not None:
                seq.wake.notify_all()  # a consumer blocked in next_token() returns None
            if seq in self.waiting:
                self.waiting.remove(seq)
            while id(seq) in self.in_flight:
                self.cond.wait()
            if seq in self.running:
                self.running.remove(seq)
            self._drop_forks(seq)
            if seq.released:
                return
            seq.released = True
        if before_release is not None and seq.blocks:
            before_release(seq)  # blocks still referenced: nothing can evict or rewrite them
        with self.cond:
            self.blocks.release(seq.blocks)
            seq.blocks = []
            self.cond.notify_all()

    def drop_forks(self, forks: Sequence[SeqState]) -> None:
        """Fail ``forks`` whose source was never submitted (it was closed first)."""
        with self.cond:
            self._fail_forks(forks)

    def _drop_forks(self, seq: SeqState) -> None:
        """``seq`` ends before its forks were made: they fail now, and free the blocks kept for them."""
        self._fail_forks(seq.forks)
        seq.forks = []

    def _fail_forks(self, forks: Sequence[SeqState]) -> None:
        for fork in forks:
            if not fork.closed and fork.error is None:
                fork.error = StepInterrupted("the choice's shared prefill did not complete")
            if fork.blocks and not fork.released:
                self.blocks.release(fork.blocks)
                fork.blocks = []
            if fork.wake is not None:
                fork.wake.notify_all()

    def stop(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        self._thread.join(timeout=10)

    # -- the loop -------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self._stop and not (plan := self._plan()):
                    self.cond.wait()
                if self._stop:
                    return
                self.in_flight = {id(s) for s, _ in plan}
                self.cond.notify_all()  # admissions happened: waiters on ``admitted`` may go on
            try:
                logits, tokens, logprobs = self._run(plan)
                error: BaseException | None = None
            except BaseException as exc:  # a failed step fails its sequences, not the worker
                log.error("gpu_step_failed", exc_info=exc)
                logits, tokens, logprobs, error = [], None, None, exc
            with self.cond:
                self.in_flight = set()
                if error is not None:
                    for seq, _ in plan:
                        seq.error = error
                else:
                    self._commit(plan, logits, tokens, logprobs)
                self.steps_total += 1
                for seq, _ in plan:
                    if seq.wake is not None:
                        seq.wake.notify_all()
                self.cond.notify_all()
            if self.on_step is not None:
                self.on_step(len(plan), sum(len(seg.token_ids) for _, seg in plan))

    def _run(
        self, plan: list[tuple[SeqState, Segment]]
    ) -> tuple[list[Tensor], list[int] | None, list[SampledLogprobs | None] | None]:
        """One model step: per-segment logits (eager), and each segment's next token when the device
        sampler chose it (static decode on), with the logprobs of the segments that asked for them
        (computed on the device, fetched in the same copy); the sequences that need no token ignore theirs."""
        segments = [seg for _, seg in plan]
        static = self.static
        if static is None:
            return self.forward(segments), None, None
        rows = [seq.sampler.row for seq, _ in plan]
        steps = [seq.generated for seq, _ in plan]
        penalties = [seq.sampler.penalties for seq, _ in plan]
        tops = [seq.sampler.top for seq, _ in plan]
        # A row that needs no token now (prefill chunk, replay) still gets its grammar's mask: harmless.
        # A prefill that ends with forks to make needs its logits row (a static step returns none).
        masks = [seq.sampler.mask() for seq, _ in plan]
        if static.fits(segments) and not any(seq.forks for seq, _ in plan):
            return [], *static.step_with_logprobs(segments, rows, steps, penalties, tops, masks=masks)
        logits = self.forward(segments)
        last = torch.cat([row[-1:] for row in logits])
        return logits, *sample_rows_with_logprobs(last, rows, steps, penalties, tops, masks=masks)

    def _run_imports(self) -> None:
        while self.imports:
            job = self.imports.pop(0)
            try:
                job.imported = self._import(job.keys, job.data)
            except Exception as exc:  # e.g. a broken TP group: the import fails, the scheduler goes on
                log.error("kv_import_write_failed", exc_info=exc)
                job.error = exc
            job.done = True
        self.cond.notify_all()

    def _import(self, keys: list[str], data: list[Tensor]) -> int:
        blocks = self.blocks
        todo = [i for i, key in enumerate(keys) if not blocks.is_cached(key)]
        # Pin the chain's cached blocks so allocating for the rest cannot evict them.
        pinned = [b for i, key in enumerate(keys) if blocks.is_cached(key) for b in blocks.acquire_prefix([key])]
        todo = todo[: blocks.available]
        fresh = blocks.allocate(len(todo)) or []
        try:
            if fresh:
                self.write_blocks(fresh, [data[i] for i in todo])
                for block, i in zip(fresh, todo, strict=True):
                    blocks.register(block, keys[i], exported=True)
        finally:
            blocks.release(pinned + fresh)  # named blocks become cached (LRU); on failure fresh ones are freed
        return len(fresh)

    def _admit(self) -> None:
        self.waiting.sort(key=lambda s: (-s.priority, s.arrival))
        while self.waiting:
            seq = self.waiting[0]
            bt = self.block_tokens
            matchable = (seq.prompt_len - 1) // bt  # at least one prompt token is prefilled (logits)
            local = self.blocks.acquire_prefix(seq.keys[:matchable])
            imported = seq.imported[len(local) : matchable]
            total = -(-seq.reserve // bt)
            forks = [f for f in seq.forks if not f.closed]
            own = total - seq.prompt_len // bt  # a fork's blocks besides the shared full prompt blocks
            fresh = self.blocks.allocate(total - len(local) + own * len(forks))
            if fresh is None:
                self.blocks.release(local)
                return
            self.waiting.pop(0)
            for i, fork in enumerate(forks):  # reserved now, so a fork never waits for KV
                fork.blocks = fresh[total - len(local) + i * own : total - len(local) + (i + 1) * own]
            fresh = fresh[: total - len(local)]
            seq.forks = forks
            if imported:
                self.write_blocks(fresh[: len(imported)], imported)
            for i in range(len(imported)):
                self.blocks.register(fresh[i], seq.keys[len(local) + i], exported=True)
            seq.imported = []
            seq.blocks = local + fresh
            seq.computed = (len(local) + len(imported)) * bt
            seq.named = len(local) + len(imported)
            seq.reused_local = len(local) * bt
            seq.reused_redis = len(imported) * bt
            seq.admitted = True
            self.running.append(seq)

    def _plan(self) -> list[tuple[SeqState, Segment]]:
        if self.imports:
            self._run_imports()
        self._admit()
        plan: list[tuple[SeqState, Segment]] = []
        budget = self.max_step_tokens
        for seq in self.running:
            if seq.closed or seq.done or budget <= 0:
                continue
            if seq.computed >= seq.prompt_len and len(seq.out) < self.lookahead:
                plan.append((seq, Segment([seq.tokens[seq.computed]], seq.computed, seq.blocks)))
                budget -= 1
        prefilling = [s for s in self.running if s.computed < s.prompt_len and not s.closed]
        prefilling.sort(key=lambda s: (-s.priority, s.arrival))
        for seq in prefilling:
            if budget <= 0:
                break
            n = min(seq.prompt_len - seq.computed, budget)
            if seq.computed + n < seq.prompt_len and n >= self.block_tokens:
                n -= (seq.computed + n) % self.block_tokens  # chunks end on block boundaries
            chunk = seq.tokens[seq.computed : seq.computed + n]
            plan.append((seq, Segment(chunk, seq.computed, seq.blocks)))
            budget -= n
        return plan

    def _commit(
        self,
        plan: list[tuple[SeqState, Segment]],
        logits: list[Tensor],
        tokens: list[int] | None,
        logprobs: list[SampledLogprobs | None] | None = None,
    ) -> None:
        for i, (seq, seg) in enumerate(plan):
            try:
                if tokens is not None:
                    row = logits[i] if logits else None
                    self._advance(seq, len(seg.token_ids), row, tokens[i], logprobs[i] if logprobs else None)
                else:
                    self._advance(seq, len(seg.token_ids), logits[i])
            except Exception as exc:  # e.g. a sampling error: that sequence fails, the others go on
                log.error("gpu_sequence_failed", exc_info=exc)
                seq.error = exc

    def _advance(
        self,
        seq: SeqState,
        n: int,
        row: Tensor | None,
        chosen: int | None = None,
        logprobs: SampledLogprobs | None = None,
    ) -> None:
        if seq.computed < seq.prompt_len:
            seq.prefilled += n
        seq.computed += n
        self._name_blocks(seq)
        if seq.computed < seq.prompt_len or seq.closed:
            return
        if seq.replay:
            replayed = seq.replay.popleft()
            seq.sampler.record(replayed)  # a resumed stream's tokens were generated: penalties count them
            seq.tokens.append(replayed)
            return
        if seq.forks:
            forks, seq.forks = seq.forks, []
            assert row is not None, "a prefill step returns logits for every segment"
            for fork in forks:
                self._fork(seq, fork, row)
        if chosen is None:
            assert row is not None, "an eager step returns logits for every segment"
            chosen = seq.sampler.pick(row[-1:])
            logprobs = seq.sampler.last_logprobs
        token = chosen
        if seq.sampler.top is not None and logprobs is not None:
            seq.out_logprobs.append(logprobs)
        seq.sampler.record(token)
        seq.generated += 1
        seq.out.append(token)
        if token in seq.eos or seq.generated >= seq.max_new:
            seq.done = True
        else:
            seq.tokens.append(token)

    def _fork(self, source: SeqState, fork: SeqState, row: Tensor) -> None:
        """Make ``fork`` a running copy of ``source`` (prefill just done) with its own first token."""
        if fork.closed or fork.released:
            return
        try:
            bt = self.block_tokens
            full = source.prompt_len // bt
            shared = source.blocks[:full]
            self.blocks.share(shared)
            own = fork.blocks
            fork.blocks = shared + own
            if source.prompt_len % bt:  # the partial last block: the source writes on in its own
                self.cache.copy_block(source.blocks[full], own[0])
            fork.computed = source.computed
            fork.admitted = True
            sampler = fork.sampler
            if self.static is not None:  # the static step's sampler, as the source's first token was chosen
                (token,), (first,) = sample_rows_with_logprobs(
                    row[-1:], [sampler.row], [0], [sampler.penalties], [sampler.top], masks=[sampler.mask()]
                )
            else:
                token = sampler.pick(row[-1:])
                first = sampler.last_logprobs
            if sampler.top is not None and first is not None:
                fork.out_logprobs.append(first)
        except Exception as exc:  # that choice fails, the others go on
            log.error("gpu_fork_failed", exc_info=exc)
            fork.error = exc
            if fork.wake is not None:
                fork.wake.notify_all()
            return
        fork.sampler.record(token)
        fork.generated = 1
        fork.out.append(token)
        if token in fork.eos or fork.generated >= fork.max_new:
            fork.done = True
        else:
            fork.tokens.append(token)
        self.running.append(fork)
        self.forks_made += 1
        if fork.wake is not None:
            fork.wake.notify_all()

    def _name_blocks(self, seq: SeqState) -> None:
        """Give the sequence's newly completed blocks their chain keys (shareable from now on)."""
        if seq.key_fn is None:
            return
        full = seq.computed // self.block_tokens
        if full <= seq.named:
            return
        if full > len(seq.keys):
            seq.keys = seq.key_fn(seq.tokens[: full * self.block_tokens])
        for i in range(seq.named, full):
            self.blocks.register(seq.blocks[i], seq.keys[i])
        seq.named = full
