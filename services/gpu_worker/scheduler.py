"""Continuous batching: one packed model step for every admitted sequence, per engine-loop step.

The worker's engine loop thread calls :meth:`Scheduler.step` back to back (services/worker/loop.py);
each step is planned and committed under the block manager's lock (the load report and the KV
transfers read it from other threads) and run without it:

1. *Admission*: waiting sequences in priority order (higher ``priority`` first, then arrival) take
   their cached prefix blocks (local LRU, plus blocks loaded from Redis before they were submitted)
   and reserve blocks for the rest of prompt + replay + ``max_tokens``; when the KV budget cannot
   hold the next one, admission stops until blocks are freed (no preemption). Blocks a
   Worker.ImportKV call loaded from Redis (``import_blocks``) are written just before, as cached
   prefix blocks nobody references yet.
2. *Decode first*: every running sequence that needs a token contributes one (so streams never
   stall behind a long prompt), then the remaining per-step token budget (``max_step_tokens``)
   goes to *chunked prefill* of admitted prompts, most urgent first.
3. One ``forward(segments)`` call (the model, or a tensor-parallel wrapper that broadcasts the
   segments to follower ranks); then the device sampler (device_sampler.py) chooses every row's token
   in one call for the whole step, and full blocks are named by their chain key so later prompts
   share them. With a ``StaticDecoder`` (graphs.py, setting ``decode_graphs``) a pure decode step runs
   there instead, with fixed shapes (a CUDA graph on a GPU) and the same sampling inside it.

The step returns every sequence's new token at once (:class:`~services.worker.types.SequenceOutput`).

Forks (n choices of one prompt, ``submit(seq, forks)``): the first choice is admitted with blocks
reserved for all of them; when its prefill's logits are there, each other choice references the
prompt's full blocks (one more reference each: full blocks are never written again), gets a device
copy of the partial last block (the first choice goes on writing its own: copy on write, done at
once), and samples its first token from the same logits with its own parameters; it then decodes as
any running sequence. The prompt is prefilled once.

:meth:`close` (between steps, on the loop thread) releases a sequence's blocks at once: a cancel
frees its KV before the next step. Resumed streams replay their tokens one decode step each (see
``NewSequence.replay``).
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
from services.common.generation import FinishReason
from services.common.logprobs import SampledLogprobs
from services.gpu_worker.blocks import BlockManager
from services.gpu_worker.device_sampler import sample_rows_with_logprobs
from services.gpu_worker.graphs import StaticDecoder
from services.gpu_worker.model import KVCache
from services.gpu_worker.plan import Segment
from services.gpu_worker.sampler import Sampler
from services.worker.types import SequenceOutput

log = structlog.get_logger(__name__)
Forward = Callable[[Sequence[Segment]], list[Tensor]]
_arrivals = count()


@dataclass(eq=False)
class SeqState:
    """One sequence as the scheduler sees it."""

    tokens: list[int]
    """Prompt, then tokens fed back (replayed or generated); ``tokens[:computed]`` have KV."""
    prompt_len: int
    replay: deque[int]
    sampler: Sampler
    max_new: int
    eos: frozenset[int]
    id: int = 0
    """The runtime's sequence id (``NewSequence.id``)."""
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
    admitted: bool = False
    done: bool = False
    released: bool = False
    prefilled: int = 0
    reused_local: int = 0
    reused_redis: int = 0
    forks: list[SeqState] = field(default_factory=list)
    """The other choices of an n-choice request, made from this sequence when its prefill ends
    (``Scheduler.submit``'s ``forks``); never queued or planned before that."""

    @property
    def reserve(self) -> int:
        return self.prompt_len + len(self.replay) + self.max_new


@dataclass(eq=False)
class ImportJob:
    """Blocks loaded from Redis for the local prefix cache, handed to the loop thread."""

    keys: list[str]
    data: list[Tensor]
    imported: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class Scheduler:
    """Plans, runs and commits the packed steps (see the module docstring). Loop thread only, except
    :meth:`import_blocks` (any thread)."""

    def __init__(
        self,
        forward: Forward,
        cache: KVCache,
        blocks: BlockManager,
        *,
        max_step_tokens: int = 512,
        on_step: Callable[[int, int], None] | None = None,
        write_blocks: Callable[[Sequence[int], Sequence[Tensor]], None] | None = None,
        static: StaticDecoder | None = None,
        wake: Callable[[], None] | None = None,
    ) -> None:
        self.forward = forward
        self.static = static  # pure decode steps run with static shapes (graphs.py)
        self.cache = cache
        # Writes imported (Redis) blocks into the cache; under TP it scatters head slices to every rank.
        self.write_blocks = write_blocks or self._write_local
        self.blocks = blocks
        self.lock = blocks.lock
        self.block_tokens = blocks.block_tokens
        self.max_step_tokens = max_step_tokens
        self.on_step = on_step
        self.wake = wake or (lambda: None)
        """Makes the engine loop look for work again (an import arrived)."""
        self.waiting: list[SeqState] = []
        self.running: list[SeqState] = []
        self.imports: list[ImportJob] = []
        self.failed: list[SequenceOutput] = []
        """Outputs of sequences that failed outside a model call (a fork that could not be made)."""
        self.steps_total = 0
        self.forks_made = 0
        """Choices made from another sequence's prefill (``submit``'s forks)."""
        self._stopped = False
        self._stalled_at: int | None = None
        """``blocks.available`` when the waiting queue's head last failed to get blocks (None: not stalled)."""

    def _write_local(self, ids: Sequence[int], data: Sequence[Tensor]) -> None:
        for block, block_data in zip(ids, data, strict=True):
            self.cache.write_block(block, block_data)

    def fork_blocks(self, seq: SeqState, n: int) -> int:
        """KV blocks ``n`` choices of ``seq`` hold at most: its own, plus per other choice all but the
        prompt's full blocks (shared)."""
        total = -(-seq.reserve // self.block_tokens)
        return total + (n - 1) * (total - seq.prompt_len // self.block_tokens)

    def check_fits(self, seq: SeqState, n: int = 1) -> None:
        """ResourceExhausted when ``n`` choices of ``seq`` could never fit the KV budget (even empty)."""
        need = self.fork_blocks(seq, n)
        if need > self.blocks.num_blocks:
            raise ResourceExhausted(
                f"prompt + max_tokens needs {need} KV blocks but the worker's KV budget holds "
                f"{self.blocks.num_blocks}; lower max_tokens or raise MESHSERVE_GPU_WORKER_KV_BUDGET_BYTES",
                retry_after_ms=0,
            )

    def submit(self, seq: SeqState, forks: Sequence[SeqState] = ()) -> None:
        """Queue ``seq``; ``forks`` (the other choices, same prompt and budget) are made from it when its
        prefill ends. ResourceExhausted when they could never fit the KV budget."""
        self.check_fits(seq, 1 + len(forks))
        seq.forks = list(forks)
        self.waiting.append(seq)
        self._stalled_at = None  # it may come first (priority) and fit

    def has_work(self) -> bool:
        """Whether :meth:`step` would do anything: imports, failures to report, running sequences, or
        waiting ones that may be admitted now (not while admission is stalled on blocks and none were
        freed since, so the loop sleeps instead of spinning on empty steps until a wake-up)."""
        if self.imports or self.failed or any(not s.done for s in self.running):
            return True
        return bool(self.waiting) and self.blocks.available != self._stalled_at

    def import_blocks(self, keys: Sequence[str], data: Sequence[Tensor]) -> int:
        """Cache ``data`` (full-head blocks from Redis) under their chain ``keys`` as unreferenced,
        evictable prefix blocks; returns how many were written. Blocking (any thread but the loop's).

        Like imports on admission, the blocks are written by the loop thread between two steps
        (``_plan``), so no forward runs while the cache (on every TP rank) is written (the worker's engine
        loop runs from the worker's start). Keys cached already are skipped; the import stops where the
        KV budget (free + evictable) has no room.
        """
        job = ImportJob(list(keys), list(data))
        with self.lock:
            if self._stopped:
                raise Unavailable("the worker is shutting down; import the prefix into another replica")
            self.imports.append(job)
        self.wake()
        while not job.done.wait(0.5):
            if self._stopped:
                raise Unavailable("the worker is shutting down; import the prefix into another replica")
        if job.error is not None:
            raise job.error
        return job.imported

    def close(self, seq: SeqState, before_release: Callable[[SeqState], None] | None = None) -> None:
        """Stop ``seq`` and free its KV blocks now (between steps); its forks not made yet fail."""
        with self.lock:
            seq.done = True
            self._stalled_at = None  # the queue's head or the blocks held change
            if seq in self.waiting:
                self.waiting.remove(seq)
            if seq in self.running:
                self.running.remove(seq)
            self._fail_forks(seq.forks)
            seq.forks = []
            if seq.released:
                return
            seq.released = True
        if before_release is not None and seq.blocks:
            before_release(seq)  # blocks still referenced: nothing can evict or rewrite them
        with self.lock:
            self.blocks.release(seq.blocks)
            seq.blocks = []

    def discard_outputs(self, seq_id: int) -> None:
        """Drop ``seq_id``'s outputs not handed over yet (it was stopped: they would come late)."""
        with self.lock:
            if any(out.id == seq_id for out in self.failed):
                self.failed = [out for out in self.failed if out.id != seq_id]

    def _fail_forks(self, forks: Sequence[SeqState]) -> None:
        """``forks`` whose source ended before its prefill did: they end CANCELLED (their blocks freed)."""
        for fork in forks:
            if fork.blocks and not fork.released:
                self.blocks.release(fork.blocks)
                fork.blocks = []
            if not fork.done:
                fork.done = fork.released = True
                self.failed.append(SequenceOutput(fork.id, finish=FinishReason.CANCELLED))

    def stop(self) -> None:
        """Refuse further imports (the worker is stopping)."""
        self._stopped = True
        with self.lock:
            for job in self.imports:
                job.error = Unavailable("the worker is shutting down; import the prefix into another replica")
                job.done.set()
            self.imports = []

    # -- the step --------------------------------------------------------------------------------

    def step(self) -> list[SequenceOutput]:
        """One packed step over every admitted sequence (see the module docstring)."""
        with self.lock:
            plan = self._plan()
            outputs, self.failed = self.failed, []
        if not plan:
            return outputs
        try:
            logits, tokens, logprobs = self._run(plan)
        except Exception as exc:  # a failed step fails its sequences, not the worker
            log.error("gpu_step_failed", exc_info=exc)
            for seq, _ in plan:
                outputs.append(SequenceOutput(seq.id, error=exc))
                seq.done = True
            return outputs
        with self.lock:
            self._commit(plan, logits, tokens, logprobs, outputs)
            self.steps_total += 1
        if self.on_step is not None:
            self.on_step(len(plan), sum(len(seg.token_ids) for _, seg in plan))
        return outputs

    def _run(
        self, plan: list[tuple[SeqState, Segment]]
    ) -> tuple[list[Tensor], list[int], list[SampledLogprobs | None]]:
        """One model step: per-segment logits (eager; none from a static step), and each segment's next
        token, chosen by the device sampler in one call for the whole step, with the logprobs of the
        segments that asked for them (computed on the device, fetched in the same copy); the
        sequences that need no token ignore theirs."""
        segments = [seg for _, seg in plan]
        static = self.static
        rows = [seq.sampler.row for seq, _ in plan]
        # The device sampler's noise is a function of (seed, step, token), ``step`` the turn's tokens so
        # far: replayed ones included, so a resumed seeded stream draws what the undisturbed one drew.
        steps = [len(seq.tokens) - seq.prompt_len for seq, _ in plan]
        penalties = [seq.sampler.penalties for seq, _ in plan]
        tops = [seq.sampler.top for seq, _ in plan]
        # A row that needs no token now (prefill chunk, replay) still gets its grammar's mask: harmless.
        # A prefill that ends with forks to make needs its logits row (a static step returns none).
        masks = [seq.sampler.mask() for seq, _ in plan]
        if static is not None and static.fits(segments) and not any(seq.forks for seq, _ in plan):
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
            job.done.set()

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
            forks = [f for f in seq.forks if not f.done]
            own = total - seq.prompt_len // bt  # a fork's blocks besides the shared full prompt blocks
            fresh = self.blocks.allocate(total - len(local) + own * len(forks))
            if fresh is None:
                self.blocks.release(local)
                self._stalled_at = self.blocks.available
                return
            self._stalled_at = None
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
            if seq.done or budget <= 0:
                continue
            if seq.computed >= seq.prompt_len:
                plan.append((seq, Segment([seq.tokens[seq.computed]], seq.computed, seq.blocks)))
                budget -= 1
        prefilling = [s for s in self.running if s.computed < s.prompt_len and not s.done]
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
        tokens: list[int],
        logprobs: list[SampledLogprobs | None],
        outputs: list[SequenceOutput],
    ) -> None:
        for i, (seq, seg) in enumerate(plan):
            try:
                row = logits[i] if logits else None
                self._advance(seq, len(seg.token_ids), row, outputs, tokens[i], logprobs[i])
            except Exception as exc:  # e.g. a sampling error: that sequence fails, the others go on
                log.error("gpu_sequence_failed", exc_info=exc)
                seq.done = True
                outputs.append(SequenceOutput(seq.id, error=exc))

    def _advance(
        self,
        seq: SeqState,
        n: int,
        row: Tensor | None,
        outputs: list[SequenceOutput],
        chosen: int,
        logprobs: SampledLogprobs | None,
    ) -> None:
        if seq.computed < seq.prompt_len:
            seq.prefilled += n
        seq.computed += n
        self._name_blocks(seq)
        if seq.computed < seq.prompt_len or seq.done:
            return
        if seq.replay:
            replayed = seq.replay.popleft()
            seq.sampler.replayed(replayed)  # a resumed stream's tokens were generated: penalties count them
            seq.tokens.append(replayed)
            return
        if seq.forks:
            forks, seq.forks = seq.forks, []
            assert row is not None, "a prefill step returns logits for every segment"
            for fork in forks:
                self._fork(seq, fork, row, outputs)
        self._emit(seq, chosen, logprobs if seq.sampler.top is not None else None, outputs)

    def _emit(
        self,
        seq: SeqState,
        token: int,
        logprobs: SampledLogprobs | None,
        outputs: list[SequenceOutput],
    ) -> None:
        """``seq`` chose ``token``: its output row (with the first token, the context tokens it ran
        through the model: the prompt's computed part and the replayed tokens); EOS or ``max_new`` ends it."""
        seq.sampler.record(token)
        seq.generated += 1
        out = SequenceOutput(seq.id, [token], [logprobs] if logprobs is not None else None)
        if seq.generated == 1:
            out.prefill_tokens = seq.prefilled + (seq.computed - seq.prompt_len)
        if token in seq.eos or seq.generated >= seq.max_new:
            seq.done = True
            out.finish = FinishReason.STOP if token in seq.eos else FinishReason.LENGTH
        else:
            seq.tokens.append(token)
        outputs.append(out)

    def _fork(self, source: SeqState, fork: SeqState, row: Tensor, outputs: list[SequenceOutput]) -> None:
        """Make ``fork`` a running copy of ``source`` (prefill just done) with its own first token."""
        if fork.done or fork.released:
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
            sampler = fork.sampler  # the device sampler, as the source's first token was chosen
            (token,), (first,) = sample_rows_with_logprobs(
                row[-1:], [sampler.row], [0], [sampler.penalties], [sampler.top], masks=[sampler.mask()]
            )
        except Exception as exc:  # that choice fails, the others go on
            log.error("gpu_fork_failed", exc_info=exc)
            fork.done = True
            outputs.append(SequenceOutput(fork.id, error=exc))
            return
        self.running.append(fork)
        self.forks_made += 1
        self._emit(fork, token, first if sampler.top is not None else None, outputs)
        outputs[-1].prefill_tokens = 0  # it ran nothing: the source's prefill was its

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
