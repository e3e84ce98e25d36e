"""The onnxruntime edge engine (setting ``engine: batched``, the default): every live sequence's
decode step runs in one onnxruntime call.

Why not one ``og.Generator`` per sequence (:mod:`services.edge_worker.og_engine`): decode of a 135M INT4
model reads all weights for every token, and onnxruntime-genai holds the GIL during a step, so N
sequences take turns and N streams give ~1x one stream's tokens/s. onnxruntime-genai's own batching
``og.Engine`` was measured slower than that up to 8 streams and ~1.2x at 16, with batched greedy
tokens that differed from single-stream ones (docs/edge.md). Here the builder's ONNX graph runs
directly on onnxruntime (which releases the GIL): one decode call has one row per sequence
(MatMulNBits then reads the weights once for all of them), KV lives in per-layer slot buffers shared
by past and present (:mod:`services.edge_worker.kvslots`).

The engine core contract (services/worker/types.py): the worker's engine loop thread adds and stops
sequences between steps and calls :meth:`OrtEngine.step` back to back; a step prefills new
prompts (chunked; new prompts whose first chunks have the same length share one call:
``prefill_groups``), then runs one decode call for all the rest, and returns every row's token.

Background sequences (batch lines, ``NewSequence.background``) yield: while a foreground sequence is
active on this engine, or the host's foreground flag is set (``hold_background``: the router runs a
foreground turn on another worker of this host), every step leaves them out (no prefill chunk, no
decode row; they wait), for at most ``max_hold_s`` at a time (:mod:`services.edge_worker.hold`):
delayed, never starved; an interactive first token never comes out of a step with batch work in it.
A step of batch work only that is running when foreground work arrives is stopped part-way and run
again later (``RunOptions.terminate``; see the hold module), so an interactive turn does not wait for it.

Batch invariance: MatMulNBits' int8-activation kernels compute one row (M=1) differently from several
rows (M>=2), while rows of an M>=2 call do not depend on each other. A decode call therefore always has
at least two rows (a dummy row pads a lone sequence), so a sequence's tokens are the same whether it
runs alone or with 15 others, and a resumed stream replays exactly (tested). With ``int4_kernel="native"``
the 4-bit matmuls run on our own kernel (:mod:`services.edge_worker.native`), whose rows never depend on
M: a lone sequence then decodes in one row, still batch invariant.

Chats: a sequence held between turns (``NewSequence.hold``) keeps its KV in its slot; when a slot is
needed it is parked (its valid KV copied out, compact) and copied back when its chat continues.
``reuse`` rewinds to the longest common prefix whose KV exists and prefills only the rest.
"""

from __future__ import annotations

import gc
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort
from prometheus_client import Counter
from tokenizers import Tokenizer

from services.common.errors import FailedPrecondition, ResourceExhausted, Unavailable
from services.common.generation import FinishReason
from services.edge_worker.graph import load_sessions
from services.edge_worker.hold import BackgroundHold
from services.edge_worker.kvslots import KvSlots
from services.edge_worker.sampler import logprobs, logprobs_rows, pick
from services.edge_worker.sequence import EdgeSequence, fork_of
from services.edge_worker.spin import SessionChooser
from services.worker.types import Engine, EngineCapabilities, EngineInfo, KVUsage, NewSequence, SequenceOutput

MODEL_CALLS = Counter(
    "meshserve_edge_model_calls_total",
    "Model calls of the batched edge engine, by kind (prefill: one chunk of one or more new prompts; decode).",
    ["kind"],
)
MODEL_ROWS = Counter(
    "meshserve_edge_model_rows_total",
    "Sequences in the batched edge engine's model calls, by kind (rows / calls = sequences per call).",
    ["kind"],
)
for _kind in ("prefill", "decode"):
    MODEL_CALLS.labels(_kind)
    MODEL_ROWS.labels(_kind)


class _Preempted(Exception):
    """A model call of background sequences only was stopped for foreground work (see the hold module)."""


def prefill_groups(
    seqs: Sequence[EdgeSequence], chunk_end: Callable[[EdgeSequence], int], max_tokens: int
) -> list[list[EdgeSequence]]:
    """``seqs`` (prefilling) in groups that one model call can prefill together: first chunks (no KV
    yet: GroupQueryAttention takes several rows of more than one position only without past context)
    of the same length (``chunk_end``), at most ``max_tokens`` tokens per call (no call bigger than
    one sequence's full chunk: activations and attention scores stay bounded). Order is kept."""
    groups: dict[int, list[list[EdgeSequence]]] = {}
    ordered: list[list[EdgeSequence]] = []
    for seq in seqs:
        start, end = seq.kv_len, chunk_end(seq)
        if start > 0:  # a later chunk: a call of its own
            ordered.append([seq])
            continue
        open_groups = groups.setdefault(end, [])
        if not open_groups or (len(open_groups[-1]) + 1) * end > max_tokens:  # max_tokens 0: never share
            open_groups.append([])
            ordered.append(open_groups[-1])
        open_groups[-1].append(seq)
    return ordered


class OrtEngine(Engine):
    """The INT4 ONNX model of ``model_dir`` (as written by onnxruntime-genai's model builder), batched.

    ``max_batch``: rows of one decode call (and KV slots); the worker admits at most that many
    sequences at once (more wait in the engine). ``batch_invariant=False`` lets a lone sequence decode in a
    one-row call (faster, but its greedy tokens may then differ at near-ties from a batched run).
    ``lm_head``: ``int8`` (MLAS int8 GEMM, less CPU per row, same perplexity;
    :mod:`services.edge_worker.int8head`) or ``nbits`` (as built). ``spinning``: let idle intra-op threads
    spin before they block (faster steps; more CPU burnt), for at most ``spin_us`` microseconds when above
    0 (onnxruntime's ``session.intra_op.spin_duration_us``; 0: its default, far longer).
    ``adaptive_threading`` (with ``spinning`` off and more than one thread): two more sessions, one
    whose threads spin inside a call (and sleep between calls), one of a single thread; each decode call
    of up to ``adaptive_max_rows`` rows runs on whichever of the three measures fastest now
    (:mod:`services.edge_worker.spin`); the weights are held three times in memory.
    ``load_cache_dir``: where the edited graph is kept for the next start (:mod:`services.edge_worker.load_cache`).
    ``max_hold_s``: the longest background sequences are held out of the rounds at a time
    (:mod:`services.edge_worker.hold`). ``int4_kernel``: ``mlas`` (onnxruntime's MatMulNBits) or
    ``native`` (our row-invariant kernel as a custom op: a lone sequence decodes in one row; ValueError
    saying why when this machine cannot build or run it).
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        model_id: str,
        threads: int = 0,
        max_batch: int = 16,
        prefill_chunk: int = 512,
        kv_capacity: int = 256,
        batch_invariant: bool = True,
        lm_head: str = "int8",
        spinning: bool = False,
        spin_us: int = 0,
        adaptive_threading: bool = False,
        adaptive_max_rows: int = 4,
        load_cache_dir: Path | None = None,
        max_hold_s: float = 2.0,
        int4_kernel: str = "mlas",
    ) -> None:
        config = json.loads((model_dir / "genai_config.json").read_text())["model"]
        decoder = config["decoder"]

        def session_options(spin: bool, stop: bool, count: int = threads) -> ort.SessionOptions:
            options = ort.SessionOptions()
            if count:
                options.intra_op_num_threads = count
            options.inter_op_num_threads = 1
            # Spinning idle threads take the next parallel section at once; unbounded, they also keep the
            # cores busy between steps, which the gateway and router on a small CPU need (the worker's
            # default spins 200 us, then blocks: docs/edge.md, issue 27).
            options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
            if spin and spin_us:  # a bounded spin: idle threads block after spin_us
                options.add_session_config_entry("session.intra_op.spin_duration_us", str(spin_us))
            if stop:  # spin inside a call only: the threads sleep as soon as the call returns
                options.add_session_config_entry("session.force_spinning_stop", "1")
            return options

        if adaptive_threading and int4_kernel == "native":
            raise ValueError(
                "adaptive_threading cannot be combined with int4_kernel 'native' (its threads are in the graph)"
            )
        adaptive = adaptive_threading and not spinning and (threads or os.cpu_count() or 1) > 1

        def load() -> list[ort.InferenceSession]:  # fresh options each time: a load registers the custom ops in them
            wanted = [session_options(spinning, False)]
            if adaptive:  # the choices for small calls: these threads sleeping (above), spinning, one thread
                wanted += [session_options(True, True), session_options(False, False, 1)]
            return load_sessions(
                model_dir / decoder["filename"],
                wanted,
                lm_head=lm_head,
                cache_dir=load_cache_dir,
                int4_kernel=int4_kernel,
            )

        self._load = load
        """The sessions as at start (the edited graph from the load cache when it has it): :meth:`restore_model`."""
        sessions = load()
        # the native kernel computes every row the same way whatever M is: one row is batch invariant too
        one_row_invariant = int4_kernel == "native"
        self._small_sessions = sessions
        """The decoder sessions (the first runs every call unless adaptive threading picks another);
        empty while released (:meth:`release_model`)."""
        self.chooser = SessionChooser(len(sessions), max_rows=adaptive_max_rows) if adaptive else None
        """Which session each small decode call runs on (None: always the first)."""
        min_rows = 2 if batch_invariant and not one_row_invariant else 1  # see the module docstring
        eos = config.get("eos_token_id", [])
        self._info = EngineInfo(
            model_id=model_id,
            vocab_size=int(config["vocab_size"]),
            context_length=int(config["context_length"]),
            eos_token_ids=frozenset(eos if isinstance(eos, list) else [eos]),
            build=f"onnx-int4:{model_dir.name}/batched/lm_head={lm_head}/rows>={min_rows}"
            + ("/int4=native" if one_row_invariant else ""),
        )
        self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.max_batch = max(2, max_batch)
        self._caps = EngineCapabilities(
            "batched",
            chat=True,
            forks=True,
            logprobs=True,
            structured=True,
            penalties=True,
            background=True,
            sleeps=True,
        )
        self.min_rows = min_rows
        self.prefill_chunk = max(4, prefill_chunk)

        def new_kv(capacity: int = kv_capacity) -> KvSlots:
            return KvSlots(
                layers=int(decoder["num_hidden_layers"]),
                kv_heads=int(decoder["num_key_value_heads"]),
                head_size=int(decoder["head_size"]),
                slots=self.max_batch,
                capacity=capacity,
                max_capacity=self._info.context_length,
            )

        self._new_kv = new_kv
        self._kv = new_kv()
        self._owners: list[EdgeSequence | None] = [None] * self.max_batch
        self._decode_logits: np.ndarray | None = self._logits_buffer()
        """Where decode calls write their logits (bound as the output, rows ``[0, rows)``): no output allocation
        and no copy per step (0.36 ms of a ~10 ms one-row step, measured). A step's rows are read before the next
        call; None when the graph leaves the vocabulary's width open (then onnxruntime allocates as usual)."""
        self._parked_bytes = 0
        self._live: dict[int, EdgeSequence] = {}
        """Sequences generating, in arrival order (a fork not made yet too)."""
        self._held: dict[int, EdgeSequence] = {}
        """Chat sequences between turns (``NewSequence.hold``): KV kept, not stepped."""
        self._ended: list[SequenceOutput] = []
        """Outputs of sequences that ended outside a model call (a fork whose source stopped, a
        failure), returned by the next step."""
        self._lock = threading.Lock()
        """Guards ``_preemptible`` and ``_interrupt_pending`` (the loop thread sets them,
        ``interrupt_background`` reads them from any thread)."""
        self._interrupt_pending = False
        """``interrupt_background`` came while no preemptible step was running: the loop thread may be
        about to start one of batch work only, before it applies the foreground command that came with
        the interrupt; that step then stops at once (guarded by ``_lock``; cleared when a step starts)."""
        self.steps = 0
        """Decode calls run so far (a batch of any size counts once)."""
        self.rows = 0
        """Sequence rows decoded so far (rows / steps = mean batch size)."""
        self.prefill_calls = 0
        """Prefill calls started so far (each runs one chunk of one or more sequences)."""
        self.group_prefill = True
        """New prompts whose first chunks have the same length share a prefill call (False: one sequence
        per call, the baseline of ``benchmarks.edge.prefill_groups``; the tokens are the same)."""
        self.prefill_rows = 0
        """Prefill chunks started so far (rows of those calls: rows / calls = sequences per call)."""
        self.forks_made = 0
        """Choices started as a copy of another sequence's prefilled prompt (``NewSequence.fork_of``)."""
        self.hold = BackgroundHold(max_hold_s=max_hold_s)
        """When background sequences sit out a step (its counters: steps held, seconds held, bound hits)."""
        self._preemptible: ort.RunOptions | None = None
        """The run options of the step in progress when it holds background sequences only and began
        while nothing held them (guarded by ``_lock``): foreground work arriving sets its ``terminate``."""

    @property
    def _session(self) -> ort.InferenceSession:
        return self._small_sessions[0]

    def _logits_buffer(self) -> np.ndarray | None:
        width = self._session.get_outputs()[0].shape[-1]
        return np.empty((self.max_batch, 1, width), np.float32) if isinstance(width, int) and width > 0 else None

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def capabilities(self) -> EngineCapabilities:
        return self._caps

    def add(self, spec: NewSequence) -> None:
        """A new sequence (the engine core contract, services/worker/types.py). A chat's next turn
        (``reuse``) extends its held sequence's KV where it can; a fork waits for its source's prefill."""
        eos = self._info.eos_token_ids
        if spec.fork_of is not None:
            source = self._live.get(spec.fork_of)
            if source is None or source.kv_len >= source.prefill_end:  # gone, or its prefill is over
                raise RuntimeError("the choice's shared prefill did not complete")
            fork = fork_of(source, spec, eos)
            source.forks.append(fork)
            self._live[spec.id] = fork
            return
        if spec.reuse is not None and (held := self._held.pop(spec.reuse, None)) is not None:
            if held.reuse(spec, self._info.context_length):
                self._live[spec.id] = held
                return
            self._free(held)
        self._live[spec.id] = EdgeSequence(spec, eos)

    def stop(self, seq_id: int, hold: bool = False) -> None:
        seq = self._live.pop(seq_id, None)
        if seq is None:
            seq = self._held.pop(seq_id, None)
            hold = False
        if seq is None:
            return
        if hold and seq.hold and seq.source is None:
            self._held[seq_id] = seq
        else:
            self._free(seq)

    def next_step_in(self) -> float | None:
        if self._ended:
            return 0.0
        if not self._live:
            return None
        if self.hold.since is not None and all(seq.background for seq in self._live.values()):
            return self.hold.wait_s(time.monotonic())  # only held batch lines: until the hold may end
        return 0.0

    def kv_usage(self) -> KVUsage:
        """Bytes of valid KV in slots plus parked copies (buffer pages beyond them are never touched)."""
        held = sum(seq.kv_len for seq in list(self._owners) if seq is not None)
        return KVUsage(used_bytes=held * self._kv.bytes_per_token + self._parked_bytes)

    @property
    def released(self) -> bool:
        """The model is released (:meth:`release_model`) and not restored yet."""
        return not self._small_sessions

    def release_model(self) -> None:
        """Drop the onnxruntime sessions (the graph and its weights), the KV slot buffers, parked chats
        and the logits buffer; the tokenizer, the session chooser's timings and the counters stay
        (the engine loop thread, no live sequence: services/worker/sleep.py)."""
        if self._live:
            raise FailedPrecondition("the edge engine cannot release its model while sequences run")
        for seq in list(self._held.values()):
            self._free(seq)
        self._held.clear()
        self._owners = [None] * self.max_batch
        self._parked_bytes = 0
        self._small_sessions = []
        self._decode_logits = None
        self._kv = self._new_kv(0)  # no buffer pages: nothing runs until restore
        gc.collect()  # the sessions' last references may sit in cycles (bindings, views)

    def restore_model(self) -> None:
        """Build the sessions again as at start (the edited graph from the load cache: no calibration
        run, the same tokens) and fresh KV slots. ResourceExhausted when onnxruntime cannot allocate,
        Unavailable when the load fails; the engine stays released then."""
        if not self.released:
            return
        try:
            sessions = self._load()
        except Exception as exc:
            if isinstance(exc, MemoryError) or "bad_alloc" in str(exc) or "Failed to allocate" in str(exc):
                raise ResourceExhausted(
                    "the host ran out of memory loading the edge model; free memory and wake it again"
                ) from None
            raise Unavailable(f"the edge model failed to load ({exc})") from None
        self._small_sessions = sessions
        self._decode_logits = self._logits_buffer()
        self._kv = self._new_kv()

    @property
    def preemptible(self) -> bool:
        """A step of background sequences only is running and foreground work arriving would stop it."""
        return self._preemptible is not None

    def interrupt_background(self) -> None:
        """Stop the model call of a step of background sequences only, if one is running, or the next
        one if it starts before the foreground work that comes with this call is added (any thread)."""
        with self._lock:
            if self._preemptible is not None:
                self._preemptible.terminate = True
            else:
                self._interrupt_pending = True

    @property
    def yields(self) -> int:
        """Steps run with the background sequences held out (:attr:`hold`)."""
        return self.hold.rounds

    def hold_background(self, until: float) -> None:
        """The host's foreground flag: background sequences sit out every step until ``until``
        (``time.monotonic``; 0 ends it now). Any thread; waits for no model call."""
        self.hold.hold_host(until)
        if until > time.monotonic():
            self.interrupt_background()
        self.wake()  # a hold that ends lets held batch lines run now

    # --- the engine loop thread -------------------------------------------------------------------

    def step(self) -> list[SequenceOutput]:
        """One step: a prefill chunk per prefilling sequence, one decode call for the rest (see the
        module docstring); the outputs of the sequences that got a token."""
        ended, self._ended = self._ended, []
        # Foreground first (stable: arrival order within each): a batch line never keeps an
        # interactive sequence out of a full step.
        runnable = [seq for seq in self._live.values() if seq.source is None]
        runnable.sort(key=lambda seq: seq.background)
        batch = runnable[: self.max_batch]
        now = time.monotonic()
        batch, held = self.hold.split(batch, now)
        quiet = bool(batch) and all(seq.background for seq in batch) and not held and self.hold.quiet(now)
        with self._lock:
            self._preemptible = ort.RunOptions() if quiet else None
            if self._preemptible is not None and self._interrupt_pending:
                self._preemptible.terminate = True  # foreground work is on its way: this step runs later
            self._interrupt_pending = False
        if not batch:
            return ended
        try:
            done = self._iterate(batch)
        except Exception as exc:  # an onnxruntime failure fails this step's sequences, not the engine
            for seq in batch:
                self._fail(seq, exc)
            done = []
        finally:
            with self._lock:
                self._preemptible = None
        outputs = [self._output(seq, token) for seq, token in done]
        ended, self._ended = ended + self._ended, []
        return outputs + ended

    def _output(self, seq: EdgeSequence, token: int) -> SequenceOutput:
        """The row of ``seq``, which just chose ``token``; a sequence that ends is held or freed."""
        out = SequenceOutput(seq.id, [token])
        if seq.sampling.logprobs and seq.next_logprobs is not None:
            out.logprobs = [seq.next_logprobs]
            seq.next_logprobs = None
        if not seq.reported:
            seq.reported = True
            out.prefill_tokens = seq.prefill_tokens
        if seq.done(token):
            out.finish = FinishReason.STOP if token in self._info.eos_token_ids else FinishReason.LENGTH
            self.stop(seq.id, hold=True)
        return out

    def _drop(self, seq: EdgeSequence) -> None:
        self._live.pop(seq.id, None)
        self._free(seq)

    def _free(self, seq: EdgeSequence) -> None:
        seq.closed = True
        for fork in seq.forks:  # stopped before its prefill ended: its forks will never be made
            if self._live.pop(fork.id, None) is not None:
                fork.closed = True
                self._ended.append(SequenceOutput(fork.id, finish=FinishReason.CANCELLED))
        seq.forks = []
        if seq.slot is not None and self._owners[seq.slot] is seq:
            self._owners[seq.slot] = None
        seq.slot = None
        if seq.parked is not None:
            self._parked_bytes -= sum(part.nbytes for part in seq.parked)
            seq.parked = None

    def _iterate(self, batch: list[EdgeSequence]) -> list[tuple[EdgeSequence, int]]:
        """A prefill chunk per prefilling sequence, one decode call for the rest; the sequences that
        chose a token (the others are still prefilling or replaying, or their call was preempted:
        nothing of theirs changed but KV positions the next run writes again)."""
        now = time.monotonic()
        for seq in batch:
            seq.last_used = now
            self._grow(min(len(seq.tokens) + 1, self._kv.max_capacity))
        for seq in batch:
            self._acquire(seq, batch)
        done: list[tuple[EdgeSequence, int]] = []
        asking: list[tuple[EdgeSequence, int, np.ndarray]] = []  # rows that want their logprobs
        stopped: list[EdgeSequence] = []
        prefilling = [seq for seq in batch if seq.prefill_end - seq.kv_len >= 2]
        decode = [seq for seq in batch if seq.prefill_end - seq.kv_len < 2]
        decode = self._place(decode)  # slots [0, len(decode)); each prefill group gets the slots after
        first = len(decode)
        groups = prefill_groups(prefilling, self._chunk_end, self.prefill_chunk if self.group_prefill else 0)
        for group in groups:
            if stopped:
                stopped += group
                continue
            group = self._place(group, first)
            first += len(group)
            try:
                rows = self._prefill(group)
            except _Preempted:
                stopped += group
                continue
            for seq, logits in zip(group, rows, strict=True):
                self._after(seq, logits, done, batch, asking)
        if decode and stopped:
            stopped += decode
        elif decode:
            try:
                logits = self._decode(decode)
            except _Preempted:
                stopped += decode
                decode = []
            for row, seq in enumerate(decode):
                self._after(seq, logits[row], done, batch, asking)
        if asking:  # one whole-batch computation for the rows that ask (sampler.logprobs_rows)
            rows = np.stack([row for _, _, row in asking]).astype(np.float32, copy=False)
            tops = [seq.sampling.top_logprobs for seq, _, _ in asking]
            found = logprobs_rows(rows, [token for _, token, _ in asking], tops)
            for (seq, _, _), entry in zip(asking, found, strict=True):
                seq.next_logprobs = entry
        return done

    def _run(self, session: ort.InferenceSession, io: ort.IOBinding) -> None:
        """One model call; raises :class:`_Preempted` when foreground work stopped it part-way."""
        options = self._preemptible
        try:
            session.run_with_iobinding(io, options)
        except Exception:
            if options is not None and options.terminate:
                self.hold.preempted()
                raise _Preempted from None
            raise

    def _after(
        self,
        seq: EdgeSequence,
        logits: np.ndarray,
        done: list[tuple[EdgeSequence, int]],
        batch: list[EdgeSequence],
        asking: list[tuple[EdgeSequence, int, np.ndarray]],
    ) -> None:
        if seq.kv_len < len(seq.tokens):
            return  # more of its context to feed before it may choose a token
        if seq.forks:  # before the row is adjusted: each choice applies its own penalties
            forks, seq.forks = seq.forks, []
            for fork in forks:
                self._fork(seq, fork, logits, batch, done)
        if seq.penalties is not None:  # the step's own row, read once: adjusted in place
            logits = seq.penalties.apply(logits, in_place=True)
        # Logprobs are of the row after the penalties, before the grammar's mask (which edits the row).
        row = logits.copy() if seq.sampling.logprobs and seq.constraint is not None else logits
        token = pick(logits, seq.sampling, seq.rng, None, seq.constraint)
        if seq.sampling.logprobs:  # of the row it was drawn from (penalties applied): after the step's rows
            asking.append((seq, token, row))
        if seq.penalties is not None:
            seq.penalties.record(token)
        if seq.constraint is not None:
            seq.constraint.advance(token)
        seq.tokens.append(token)
        seq.generated += 1
        seq.prefill_end = max(seq.prefill_end, seq.kv_len)
        done.append((seq, token))

    def _fork(
        self,
        source: EdgeSequence,
        fork: EdgeSequence,
        logits: np.ndarray,
        batch: list[EdgeSequence],
        done: list[tuple[EdgeSequence, int]],
    ) -> None:
        """Make ``fork`` a copy of ``source`` right after its prefill, with its own first token."""
        if fork.closed:  # stopped meanwhile
            return
        fork.source = None
        if None not in self._owners and all(s is None or s in batch or s is source for s in self._owners):
            self._fail(fork, RuntimeError("no KV slot is free for another choice"))
            return
        try:  # a fork made earlier in this step may be parked for it: it waits for a slot, then decodes
            self._acquire(fork, [*batch, source])
            assert fork.slot is not None and source.slot is not None
            self._kv.copy(source.slot, fork.slot, source.kv_len)
            fork.kv_len = source.kv_len
            fork.prefill_end = max(fork.prefill_end, fork.kv_len)
            fork.last_used = source.last_used
            row = logits.copy()  # the source's row, before its own penalties: this choice applies its own
            if fork.penalties is not None:
                row = fork.penalties.apply(row, in_place=True)
            kept = row.copy() if fork.sampling.logprobs else None
            token = pick(row, fork.sampling, fork.rng, None, fork.constraint)
            if kept is not None:
                fork.next_logprobs = logprobs(kept, token, fork.sampling.top_logprobs)
            if fork.penalties is not None:
                fork.penalties.record(token)
            if fork.constraint is not None:
                fork.constraint.advance(token)
            fork.tokens.append(token)
            fork.generated = 1
        except Exception as exc:  # that choice fails, the others go on
            self._fail(fork, exc)
            return
        self.forks_made += 1
        done.append((fork, token))

    def _fail(self, seq: EdgeSequence, error: BaseException) -> None:
        """``seq`` fails alone (reported with the step's outputs) and is freed."""
        self._drop(seq)
        self._ended.append(SequenceOutput(seq.id, error=error))

    def _acquire(self, seq: EdgeSequence, batch: list[EdgeSequence]) -> None:
        """Give ``seq`` a slot (parking the least recently used sequence outside ``batch`` if needed)."""
        if seq.slot is not None:
            return
        if None not in self._owners:
            members = set(batch)
            victims = [s for s in self._owners if s is not None and s not in members]
            victim = min(victims, key=lambda s: s.last_used)
            assert victim.slot is not None
            victim.parked = self._kv.copy_out(victim.slot, victim.kv_len)
            self._parked_bytes += sum(part.nbytes for part in victim.parked)
            self._owners[victim.slot] = None
            victim.slot = None
        slot = self._owners.index(None)
        self._owners[slot] = seq
        seq.slot = slot
        if seq.parked is not None:
            self._kv.copy_in(slot, seq.parked)
            self._parked_bytes -= sum(part.nbytes for part in seq.parked)
            seq.parked = None

    def _chunk_end(self, seq: EdgeSequence) -> int:
        """Where ``seq``'s next prefill chunk ends."""
        end = min(seq.prefill_end, seq.kv_len + self.prefill_chunk)
        if seq.prefill_end - end == 1:
            end -= 1  # never leave a single prompt token for a decode row of a different shape
        return end

    def _prefill(self, group: list[EdgeSequence]) -> np.ndarray:
        """One call for the next chunk of each of ``group`` (``prefill_groups``: one sequence, or first
        chunks of one length), in the consecutive slots ``_place`` gave them; row i = the last position's
        logits of ``group[i]``."""
        first, start = group[0].slot, group[0].kv_len
        assert first is not None
        end = self._chunk_end(group[0])
        self.prefill_calls += 1
        self.prefill_rows += len(group)
        self._grow(end)
        io = self._kv.binding(self._session, first, len(group))
        ids = np.array([seq.tokens[start:end] for seq in group], dtype=np.int64)
        mask = np.ones((len(group), end), dtype=np.int64)
        io.bind_cpu_input("input_ids", ids)
        io.bind_cpu_input("attention_mask", mask)
        io.bind_output("logits")  # unallocated again: its shape changes between runs
        self._run(self._session, io)
        MODEL_CALLS.labels("prefill").inc()
        MODEL_ROWS.labels("prefill").inc(len(group))
        for seq in group:
            seq.kv_len = end
        logits: np.ndarray = io.get_outputs()[0].numpy()
        return logits[:, -1]

    def _place(self, seqs: list[EdgeSequence], first: int = 0) -> list[EdgeSequence]:
        """Move ``seqs`` into the slots ``[first, first + len(seqs))``, ordered by slot; a sequence
        already there stays put.

        Rows of an M>=2 call do not depend on each other, so the row order is free: keeping each
        sequence in its slot means a steady batch moves no KV at all (ordering rows by arrival instead
        swapped KV on most steps: ~15 % of the CPU per token at 16 streams).
        """
        wanted = range(first, first + len(seqs))
        holes = iter(sorted(set(wanted) - {seq.slot for seq in seqs}))
        for seq in seqs:
            assert seq.slot is not None
            if seq.slot not in wanted:
                self._move(seq, next(holes))
        return sorted(seqs, key=lambda seq: seq.slot or 0)

    def _decode(self, seqs: list[EdgeSequence]) -> np.ndarray:
        """One call, row i = ``seqs[i]``, which sits in slot i; a lone sequence gets a dummy second row."""
        rows = max(self.min_rows, len(seqs))
        lengths = [seq.kv_len for seq in seqs]
        ids = [seq.tokens[seq.kv_len] for seq in seqs]
        for slot in range(len(seqs), rows):  # dummy rows write one position past their owner's KV
            owner = self._owners[slot]
            lengths.append(owner.kv_len if owner is not None else 0)
            ids.append(0)
        width = max(lengths) + 1
        self._grow(width)
        mask = np.zeros((rows, width), dtype=np.int64)
        for row, length in enumerate(lengths):
            mask[row, : length + 1] = 1
        mode = None if self.chooser is None else self.chooser.choose(rows)
        session = self._session if mode is None else self._small_sessions[mode]
        io = self._kv.binding(session, 0, rows)
        id_array = np.array(ids, dtype=np.int64).reshape(rows, 1)
        io.bind_cpu_input("input_ids", id_array)
        io.bind_cpu_input("attention_mask", mask)
        out = None if self._decode_logits is None else self._decode_logits[:rows]
        if out is None:
            io.bind_output("logits")  # unallocated again: its shape changes between runs
        else:
            io.bind_output("logits", "cpu", 0, np.float32, list(out.shape), out.ctypes.data)
        start = time.perf_counter()
        self._run(session, io)
        if self.chooser is not None and mode is not None:
            self.chooser.record(rows, mode, time.perf_counter() - start)
        for seq in seqs:
            seq.kv_len += 1
        self.steps += 1
        self.rows += len(seqs)
        MODEL_CALLS.labels("decode").inc()
        MODEL_ROWS.labels("decode").inc(len(seqs))
        logits: np.ndarray = io.get_outputs()[0].numpy() if out is None else out
        return logits[: len(seqs), -1]

    def _grow(self, tokens: int) -> None:
        self._kv.ensure_capacity(tokens, [seq.kv_len if seq is not None else 0 for seq in self._owners])

    def _move(self, seq: EdgeSequence, slot: int) -> None:
        """Put ``seq`` in ``slot``, swapping with whoever holds it (valid KV only)."""
        assert seq.slot is not None
        if seq.slot == slot:
            return
        other = self._owners[slot]
        tokens = max(seq.kv_len, other.kv_len if other is not None else 0)
        self._kv.swap(seq.slot, slot, tokens)
        self._owners[seq.slot], self._owners[slot] = other, seq
        if other is not None:
            other.slot = seq.slot
        seq.slot = slot
