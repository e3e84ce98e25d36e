"""Cloud engine: our Llama forward (model.py) behind a continuous-batching scheduler with prefix KV reuse.

The engine core contract (services/worker/types.py): the worker's engine loop thread adds and stops
sequences between steps and calls :meth:`CloudEngine.step`, one packed step of every admitted
sequence (scheduler.py); stopping a sequence frees its KV before the next step.

Prefix reuse (docs/cloud.md): when a sequence is added it computes the chain keys of its prompt's full
blocks; blocks held locally (blocks.py LRU) are shared, and when the local cache misses part of the
prefix the longest stored chain is loaded from Redis (prefix.py) on the engine's own I/O thread, so
the loop never waits on the network: the sequence is submitted to the scheduler once its blocks are
there. When a sequence ends the full blocks it computed are exported to Redis (in the background).
Counters: prompt tokens computed vs reused from local blocks vs imported from Redis
(``prefix_counters``, Prometheus ``meshserve_prefix_tokens_total``).

Every token is chosen by the device sampler, one call per step for all rows (scheduler.py,
device_sampler.py), on CPU as on a GPU.

Load reports: ``kv_usage()`` (bytes held by live sequences, the budget, cached prefix bytes) and
``hot_prefix_blocks()`` (chain hashes of recently used cached prompt prefixes).
``import_kv`` / ``export_kv``: Worker.ImportKV / ExportKV (kv_transfer.py). ``embed``: Worker.Embed
(embed.py).

Static decode steps (``decode_graphs``, graphs.py): pure decode steps run with batch buckets and
fixed-width block tables, captured as CUDA graphs on a GPU; the budget's last KV block is then the
padding rows' block, outside the block manager.
"""

from __future__ import annotations

import contextlib
import gc
import json
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import structlog
import torch
from prometheus_client import Counter
from tokenizers import Tokenizer

from services.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from services.common.generation import FinishReason
from services.gpu_worker import embed as embedding
from services.gpu_worker import kv_transfer
from services.gpu_worker.blocks import BlockManager
from services.gpu_worker.graphs import StaticDecoder
from services.gpu_worker.model import AllReduce, KVCache, LlamaModel, Shard
from services.gpu_worker.packed import limit_primitive_cache
from services.gpu_worker.prefix import RedisPrefixCache, chain_keys, key_digest
from services.gpu_worker.sampler import Sampler
from services.gpu_worker.scheduler import Forward, Scheduler, SeqState
from services.gpu_worker.speculative import Speculation
from services.gpu_worker.tp_kv import KVBlockIO, LocalBlocks
from services.store.kv_blocks import KVContext
from services.worker.kv_transfer import KVExport, KVImport, KVPrefix
from services.worker.types import (
    Engine,
    EngineCapabilities,
    EngineInfo,
    KVUsage,
    NewSequence,
    SequenceOutput,
)

log = structlog.get_logger(__name__)

PREFIX_TOKENS = Counter(
    "meshserve_prefix_tokens_total",
    "Prompt tokens of the cloud engine by source: computed (prefilled), local (KV blocks held), redis (imported).",
    ["source"],
)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    """``auto`` is CUDA when available, else CPU; ``cuda`` without a GPU is an error."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda but torch sees no CUDA GPU; set the device to auto or cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def resolve_decode_graphs(setting: str, device: torch.device, *, tp: bool) -> str:
    """How pure decode steps run: ``graphs`` (static shapes, CUDA-graph captured), ``static`` (static
    shapes, eager: the CPU) or ``off`` (the eager packed step). ``auto`` is graphs on CUDA, else off;
    ``on`` is graphs on CUDA, static on CPU. Tensor parallelism runs eager steps (its followers mirror
    the packed step), so there it is always off."""
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"decode_graphs must be auto, on or off, not {setting!r}")
    if setting == "off" or tp:
        if tp and setting == "on":
            log.warning("decode_graphs_off_under_tensor_parallelism")
        return "off"
    if device.type == "cuda":
        return "graphs"
    return "static" if setting == "on" else "off"


def resolve_kv_dtype(kv_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """``auto``: the model dtype when it is 16-bit, else float16 (half the memory; Redis stores it exactly)."""
    if kv_dtype != "auto":
        return _DTYPES[kv_dtype]
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16


class ShardGroup(Protocol):
    """The other ranks of a tensor-parallel group, as rank 0's engine drives them (``tp.Leader``): they
    allocate a cache like the engine's, and drop and load their shards when it sleeps and wakes."""

    def share_cache(self, cache: KVCache) -> KVCache: ...

    def release(self) -> None: ...

    def restore(self) -> None: ...


class CloudEngine(Engine):
    """A Llama-family model served with continuous batching and prefix KV reuse."""

    def __init__(
        self,
        model: str,
        *,
        model_id: str,
        model_version: str = "",
        device: str = "auto",
        dtype: str = "auto",
        kv_dtype: str = "auto",
        threads: int = 0,
        cpu_primitive_cache: int = 128,
        kv_budget_bytes: int = 512 << 20,
        block_tokens: int = 16,
        max_step_tokens: int = 512,
        prefix_cache: bool = True,
        redis: RedisPrefixCache | None = None,
        allow_download: bool = False,
        shard: Shard | None = None,
        all_reduce: AllReduce | None = None,
        wrap_forward: Callable[[Forward], Forward] | None = None,
        kv_io: KVBlockIO | None = None,
        decode_graphs: str = "auto",
        max_batch: int = 32,
        load_cache_dir: Path | None = None,
        group: ShardGroup | None = None,
    ) -> None:
        """``group``: the followers of a tensor-parallel rank 0 (they share each cache the engine builds,
        and sleep and wake with it); with ``shard``, ``all_reduce``, ``wrap_forward`` and ``kv_io``."""
        if threads:
            torch.set_num_threads(threads)  # process-wide: one worker per process
        limit_primitive_cache(cpu_primitive_cache)  # before the first matmul (process-wide, packed.py)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.kv_dtype = resolve_kv_dtype(kv_dtype, self.dtype)
        shard = shard or Shard()
        self.block_tokens = block_tokens
        self.tensor_parallel = shard.world > 1 or wrap_forward is not None
        """Forks (``NewSequence.fork_of``) would copy blocks on this rank only: under tensor parallelism
        the engine declares no forks, and n choices are independent sequences."""
        self.decode_graphs = resolve_decode_graphs(
            decode_graphs, self.device, tp=shard.world > 1 or wrap_forward is not None
        )
        self.model_id = model_id
        self.model_version = model_version or model_id
        self.prefix_cache = prefix_cache
        # Redis blocks hold every KV head; a TP rank holds a slice, so TP needs the group's gather/scatter.
        self.redis = redis if shard.world == 1 or kv_io is not None else None
        self.kv_io: KVBlockIO = kv_io or LocalBlocks()

        def load() -> None:  # the model and everything sized by it: at start, and again by restore_model()
            self._load_model(
                model,
                shard=shard,
                all_reduce=all_reduce,
                allow_download=allow_download,
                load_cache_dir=load_cache_dir,
                kv_budget_bytes=kv_budget_bytes,
                max_step_tokens=max_step_tokens,
                wrap_forward=wrap_forward,
                max_batch=max_batch,
            )

        self._reload = load
        self._group = group
        self._released = False
        self._draft: tuple[Any, int] | None = None
        load()
        cfg = self.model.config
        self._tokenizer = _load_tokenizer(model, allow_download)
        dtypes = f"{str(self.dtype).removeprefix('torch.')}/kv={str(self.kv_dtype).removeprefix('torch.')}"
        self._info = EngineInfo(
            model_id=model_id,
            vocab_size=cfg.vocab,
            context_length=cfg.max_positions,
            eos_token_ids=frozenset(_eos_ids(model, allow_download)),
            build=f"torch:{self.device.type}/{dtypes}/tp={shard.world}/decode={self.decode_graphs}",
        )
        self._caps = EngineCapabilities(
            "cloud",
            forks=not self.tensor_parallel,  # a fork copies blocks on this rank only
            logprobs=True,
            structured=True,
            penalties=True,
            kv_transfer=True,  # refused with the reason when the prefix cache or Redis is off (kv_transfer.py)
            embeddings=shard.world == 1 and wrap_forward is None,
            # under tensor parallelism only with the group: the followers drop and load their shards too
            sleeps=not self.tensor_parallel or group is not None,
            load_processes=shard.world,  # torchrun --standalone: every rank on this host, each its own shard
        )
        self._states: dict[int, tuple[SeqState, KVContext | None]] = {}
        """Live sequences by id, with their KV key context (None: prefix caching off)."""
        self._loading: dict[int, Future[None]] = {}
        """Sequences whose prefix blocks are being loaded from Redis (not submitted yet)."""
        self._loaded: deque[tuple[SeqState, Sequence[SeqState]]] = deque()
        """Loaded, to be submitted by the loop thread (appended by the I/O thread)."""
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cloud-prefix-io")
        """Loads prefix blocks from Redis, so the engine loop never waits on the network."""
        self._failed: list[SequenceOutput] = []
        self.speculation: Speculation | None = None
        """Greedy requests decoded by draft-and-verify rounds (:meth:`speculate`; None: off)."""
        self._lock = threading.Lock()
        self._embed_lock = threading.Lock()
        self._embeds = shard.world == 1 and wrap_forward is None
        self.counters = {"computed": 0, "local": 0, "redis": 0}
        self._recent: OrderedDict[str, list[str]] = OrderedDict()  # last prompt block key -> its chain

    def _load_model(
        self,
        model: str,
        *,
        shard: Shard,
        all_reduce: AllReduce | None,
        allow_download: bool,
        load_cache_dir: Path | None,
        kv_budget_bytes: int,
        max_step_tokens: int,
        wrap_forward: Callable[[Forward], Forward] | None,
        max_batch: int,
    ) -> None:
        """Load the weights (mapped from the checkpoint and the fused-weights cache) and build the KV
        cache, the block manager, the static decoder (its CUDA graphs) and the scheduler over them."""
        self.model = LlamaModel.load(
            model,
            device=self.device,
            dtype=self.dtype,
            shard=shard,
            all_reduce=all_reduce,
            allow_download=allow_download,
            cache_dir=load_cache_dir,
        )
        cfg = self.model.config
        block_tokens = self.block_tokens
        self.bytes_per_block = cfg.kv_bytes_per_token(self.kv_dtype, shard.world) * block_tokens
        num_blocks = kv_budget_bytes // self.bytes_per_block
        # Static decode keeps the budget's last block out of the block manager: padding rows write there.
        usable = num_blocks - 1 if self.decode_graphs != "off" else num_blocks
        self.blocks = BlockManager(usable, block_tokens, self.bytes_per_block)
        self.cache = self.model.new_cache(num_blocks, block_tokens, self.kv_dtype)
        forward: Forward = lambda segments: self.model.forward(segments, self.cache)  # noqa: E731
        if wrap_forward is not None:
            forward = wrap_forward(forward)
        self.static: StaticDecoder | None = None
        if self.decode_graphs != "off":
            self.static = StaticDecoder(
                self.model,
                self.cache,
                max_batch=max_batch,
                pad_block=usable,
                max_context=min(cfg.max_positions, usable * block_tokens),
                capture=self.decode_graphs == "graphs",
            )
            self.static.capture_all()  # CUDA: the narrowest width now (the first steps need it); CPU: nothing
        self.scheduler = Scheduler(
            forward,
            self.cache,
            self.blocks,
            max_step_tokens=max_step_tokens,
            write_blocks=lambda ids, data: self.kv_io.write_blocks(self.cache, ids, data),
            static=self.static,
            wake=self.wake,
        )
        if self._draft is not None:  # speculation runs over the new scheduler and blocks
            self.speculate(self._draft[0], k_max=self._draft[1])
        if self._group is not None:
            self._group.share_cache(self.cache)  # the followers allocate the same paged cache (call id 0)

    @property
    def released(self) -> bool:
        """The weights and KV are released (:meth:`release_model`) and not restored yet."""
        return self._released

    def release_model(self) -> None:
        """Drop the weights (and their prepacked copies), the KV cache, the static decoder's CUDA graphs
        and the scheduler; on CUDA the allocator's cached blocks go back too (``empty_cache``). The
        tokenizer, the Redis prefix cache client, the draft model of speculation and the counters stay;
        the local prefix cache is emptied (its blocks were in the KV cache). Loop thread, no live sequence."""
        if self._released:
            return
        if self._states or self._loading or (self.speculation is not None and self.speculation.live):
            raise FailedPrecondition("the cloud engine cannot release its model while sequences run")
        self.model.packer.wait()  # its thread holds the weights until it is done
        self.blocks = BlockManager(1, self.block_tokens, self.bytes_per_block)  # nothing held, nothing cached
        with self._lock:
            self._recent.clear()
        self.speculation = None
        del self.scheduler, self.static, self.cache, self.model
        self._released = True
        if self._group is not None:
            self._group.release()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def restore_model(self) -> None:
        """Load the weights again as at start (the fused-weights cache is mapped, not rebuilt) and a fresh
        KV cache. ResourceExhausted when the device or the host runs out of memory, Unavailable when
        the load fails; the engine stays released then."""
        if not self._released:
            return
        try:
            if self._group is not None:
                self._group.restore()  # the followers load their shards while this rank loads its own
            self._reload()
        except Exception as exc:
            if self._group is not None:
                with contextlib.suppress(Exception):  # a follower that loaded drops its shard again
                    self._group.release()
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            if isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError)):
                raise ResourceExhausted(
                    "the host or the GPU ran out of memory loading the cloud model; free memory and wake it again"
                ) from None
            raise Unavailable(f"the cloud model failed to load ({exc})") from None
        self._released = False

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def capabilities(self) -> EngineCapabilities:
        return self._caps

    # -- the engine core contract (the loop thread) --------------------------------------------

    def add(self, spec: NewSequence) -> None:
        """A new sequence; a fork (``fork_of``, not under tensor parallelism) is made from its source's
        prefill. ResourceExhausted when the sequence can never fit the KV budget, InvalidArgument when
        the choices of one prompt cannot fit it at once (both raised here, before anything is queued).
        A prompt whose prefix blocks are in Redis but not held locally waits until the I/O thread
        loaded them. With speculation on, a greedy request is decoded speculatively where its KV fits."""
        speculation = self.speculation
        if speculation is not None and spec.fork_of is not None:
            leader = speculation.take_back(spec.fork_of)  # the scheduler's forks share its prefill
            if leader is not None:
                self._submit(leader)
        elif speculation is not None and speculation.accepts(spec) and speculation.add(spec):
            return
        self._submit(spec)

    def _submit(self, spec: NewSequence) -> None:
        """``add`` for the scheduler (speculation left out)."""
        if spec.fork_of is not None:
            self._add_fork(spec, spec.fork_of)
            return
        state = self._state(spec)
        self.scheduler.check_fits(state)
        ctx = self.kv_context(spec.tenant, spec.shareable) if self.prefix_cache else None
        if ctx is not None:
            bt = self.block_tokens
            state.key_fn = lambda ids: chain_keys(ctx, bt, ids)
            state.keys = state.key_fn(state.tokens[: state.prompt_len])
            matchable = (state.prompt_len - 1) // bt
            with self.blocks.lock:
                local = self.blocks.cached_prefix(state.keys[:matchable])
            if self.redis is not None and local < matchable:
                self._states[spec.id] = (state, ctx)
                self._loading[spec.id] = self._io.submit(self._load, state, ctx, matchable)
                return
        self.scheduler.submit(state, state.forks)
        self._states[spec.id] = (state, ctx)

    def _add_fork(self, spec: NewSequence, source_id: int) -> None:
        """Attach choice ``spec`` to its source's coming prefill; CANCELLED at once if the source is gone
        (it was stopped before it started)."""
        entry = self._states.get(source_id)
        if entry is None:
            self._failed.append(SequenceOutput(spec.id, finish=FinishReason.CANCELLED))
            return
        source = entry[0]
        if source.admitted:  # the runtime adds a turn's choices together, before any step
            raise RuntimeError(f"sequence {spec.id} forks {source_id}, whose prefill began without it")
        fork = self._state(spec)
        source.forks.append(fork)
        try:
            self._check_forks(source)
        except BaseException:
            source.forks.remove(fork)
            raise
        self._states[spec.id] = (fork, None)

    def _state(self, spec: NewSequence) -> SeqState:
        return SeqState(
            tokens=list(spec.prompt_ids),
            prompt_len=len(spec.prompt_ids),
            replay=deque(spec.replay),
            sampler=Sampler(spec.sampling, spec.prompt_ids, self._info.eos_token_ids, spec.constraint),
            max_new=max(1, spec.sampling.max_tokens),
            eos=self._info.eos_token_ids,
            id=spec.id,
            priority=spec.priority,
        )

    def _check_forks(self, source: SeqState) -> None:
        n = 1 + len(source.forks)
        need = self.scheduler.fork_blocks(source, n)
        if need > self.blocks.num_blocks:
            raise InvalidArgument(
                f"sampling.n = {n} choices of prompt + max_tokens need {need} KV blocks but this worker's KV "
                f"budget holds {self.blocks.num_blocks}; lower n or max_tokens"
            )

    def _load(self, state: SeqState, ctx: KVContext, matchable: int) -> None:
        """On the I/O thread: the prompt's blocks from Redis, then hand the sequence to the loop."""
        assert self.redis is not None
        try:
            state.imported = self.checked_blocks(self.redis.load(ctx, state.tokens[: matchable * self.block_tokens]))
        except Exception as exc:  # the cache fails open: the prompt is prefilled
            log.warning("kv_prefix_load_failed", error=str(exc))
        self._loaded.append((state, state.forks))
        self.wake()

    def stop(self, seq_id: int, hold: bool = False) -> None:
        if self._released:  # nothing lives while released (a late stop of a cancelled turn)
            return
        if self.speculation is not None and self.speculation.stop(seq_id):
            return
        self._failed = [out for out in self._failed if out.id != seq_id]
        self.scheduler.discard_outputs(seq_id)  # e.g. a fork's CANCELLED: its source was stopped first
        entry = self._states.pop(seq_id, None)
        if entry is None:
            return
        state, ctx = entry
        loading = self._loading.pop(seq_id, None)
        if loading is not None and not loading.cancel():  # being loaded: dropped when it is handed over
            state.done = True
        self.release(state, ctx)

    def next_step_in(self) -> float | None:
        if self._released:
            return None
        if self._loaded or self._failed or self.scheduler.has_work() or (self.speculation and self.speculation.live):
            return 0.0
        return None

    def step(self) -> list[SequenceOutput]:
        while self._loaded:
            state, forks = self._loaded.popleft()
            self._loading.pop(state.id, None)
            if state.done:  # stopped while it loaded
                continue
            try:
                self.scheduler.submit(state, forks)
            except Exception as exc:
                self._fail(state.id, exc)
        outputs, self._failed = self._failed, []
        if self.scheduler.has_work():
            outputs += self.scheduler.step()
        for out in outputs:
            if out.prefill_tokens is not None and out.id in self._states:
                self.count_prefill(self._states[out.id][0])
            if out.finish is not None or out.error is not None:
                entry = self._states.pop(out.id, None)
                if entry is not None:
                    self.release(*entry)
        if self.speculation is not None:  # after the batch's packed step, one unit each
            outputs += self.speculation.step()
        return outputs

    def speculate(self, draft_model: Any, *, k_max: int = 8) -> None:
        """Decode greedy requests speculatively with ``draft_model`` from now on
        (:class:`~services.gpu_worker.speculative.Speculation`, ``MESHSERVE_GPU_WORKER_SPECULATIVE``)."""
        self._draft = (draft_model, k_max)
        self.speculation = Speculation(
            draft_model,
            k_max=k_max,
            forward=self.scheduler.forward,
            blocks=self.blocks,
            eos=self._info.eos_token_ids,
            max_step_tokens=self.scheduler.max_step_tokens,
        )

    def _fail(self, seq_id: int, error: BaseException) -> None:
        entry = self._states.pop(seq_id, None)
        if entry is not None:
            self.release(*entry)
        self._failed.append(SequenceOutput(seq_id, error=error))

    def kv_context(self, tenant: str, shareable: bool = False) -> KVContext:
        return KVContext(self.model_id, self.model_version, tenant, shareable)

    def checked_blocks(self, blocks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Blocks of our layout only (every KV head, whatever the TP degree), in the cache dtype."""
        cfg = self.model.config
        shape = (cfg.layers, 2, cfg.kv_heads, self.block_tokens, cfg.head_dim)
        out: list[torch.Tensor] = []
        for block in blocks:
            if tuple(block.shape) != shape:
                break
            out.append(block.to(self.kv_dtype))
        return out

    def count_prefill(self, state: SeqState) -> None:
        with self._lock:
            self.counters["computed"] += state.prefilled
            self.counters["local"] += state.reused_local
            self.counters["redis"] += state.reused_redis
        for source, n in (("computed", state.prefilled), ("local", state.reused_local), ("redis", state.reused_redis)):
            if n:
                PREFIX_TOKENS.labels(source).inc(n)

    def release(self, state: SeqState, ctx: KVContext | None) -> None:
        """Stop the sequence and free its KV; export its new full blocks to Redis first."""
        export = self._export if ctx is not None and self.redis is not None else None
        self.scheduler.close(state, before_release=(lambda s: export(s, ctx)) if export and ctx else None)
        if ctx is not None and state.named:
            prompt_blocks = min(state.named, state.prompt_len // self.block_tokens)
            if prompt_blocks:
                self.remember_prefix(state.keys[:prompt_blocks])

    def remember_prefix(self, chain: list[str]) -> None:
        """List ``chain`` (block keys from the first) first in ``hot_prefix_blocks`` (load reports)."""
        with self._lock:
            self._recent[chain[-1]] = chain
            self._recent.move_to_end(chain[-1])
            while len(self._recent) > 256:
                self._recent.popitem(last=False)

    def _export(self, state: SeqState, ctx: KVContext) -> None:
        assert self.redis is not None
        with self.blocks.lock:

            def exportable(i: int) -> bool:  # named by this sequence's own chain, not in Redis yet
                block = state.blocks[i]
                return self.blocks.key_of(block) == state.keys[i] and not self.blocks.exported(block)

            first = next((i for i in range(state.named) if exportable(i)), state.named)
            end = first
            while end < state.named and exportable(end):
                end += 1
            ids = state.blocks[first:end]
            if not ids:
                return
            self.blocks.mark_exported(ids)
        try:
            data = self.kv_io.read_blocks(self.cache, ids)  # every head, gathered from the TP ranks
        except Exception as exc:  # a broken TP group: no export, but the sequence's KV is still freed
            log.warning("kv_prefix_export_failed", error=str(exc))
            return
        self.redis.store_async(ctx, state.tokens[: (first + len(data)) * self.block_tokens], data, first)

    # -- Worker.ImportKV / ExportKV (called from a thread) ----------------------------------------

    def import_kv(self, prefix: KVPrefix) -> KVImport:
        """Pre-warm the local prefix cache with the prefix's blocks from Redis (kv_transfer.py)."""
        return kv_transfer.import_prefix(self, prefix)

    def export_kv(self, prefix: KVPrefix) -> KVExport:
        """Write the prefix's locally held blocks to Redis and wait (kv_transfer.py)."""
        return kv_transfer.export_prefix(self, prefix)

    # -- Worker.Embed and load reports (any thread) -----------------------------------------------

    def embed(self, inputs: Sequence[Sequence[int]], dimensions: int = 0) -> list[list[float]]:
        """Pooled, normalised embeddings of token id lists (services/gpu_worker/embed.py); blocking.

        Runs on the calling thread beside the engine loop (it reads the weights only, no KV cache); one
        embedding batch at a time. A tensor-parallel engine refuses: its forward needs every rank.
        """
        if not self._embeds:
            raise FailedPrecondition(
                "this cloud worker runs tensor-parallel and does not serve embeddings; use a single-device replica"
            )
        cfg = self.model.config
        embedding.check_inputs(
            inputs, vocab=cfg.vocab, context=cfg.max_positions, hidden=cfg.hidden, dimensions=dimensions
        )
        with self._embed_lock:
            return embedding.embed(self.model, inputs, dimensions=dimensions)

    def kv_usage(self) -> KVUsage:
        """KV bytes referenced by live sequences, and the budget.

        Cached prefix blocks nobody references are not counted: they are evicted as soon as space is
        needed, so they never make the worker full (``kv_stats`` reports them).
        """
        used, budget, _cached = self.blocks.usage()
        return KVUsage(used_bytes=used, budget_bytes=budget)

    def kv_stats(self) -> dict[str, int]:
        """KV bytes: used by live sequences, cached for reuse, the budget; blocks evicted so far."""
        used, budget, cached = self.blocks.usage()
        evicted = self.blocks.evicted_total
        return {"used_bytes": used, "cached_bytes": cached, "budget_bytes": budget, "evicted_blocks": evicted}

    def hot_prefix_blocks(self, block_tokens: int, limit: int = 256) -> list[bytes]:
        """Chain hashes of recently used prompt prefixes still cached, each chain from its first block.

        Empty when ``block_tokens`` is not this engine's block size (the hashes would not compare).
        """
        if block_tokens != self.block_tokens:
            return []
        with self._lock:
            chains = list(reversed(self._recent.values()))
        out: list[bytes] = []
        seen: set[str] = set()
        with self.blocks.lock:
            for chain in chains:
                for key in chain:
                    if len(out) >= limit or not self.blocks.is_cached(key):
                        break
                    if key not in seen:
                        seen.add(key)
                        out.append(key_digest(key))
        return out

    def prefix_counters(self) -> dict[str, int]:
        """Prompt tokens so far: computed by prefill, reused from local blocks, imported from Redis."""
        with self._lock:
            return dict(self.counters)

    def close(self) -> None:
        if not self._released:  # released: no scheduler, no import waiting on it
            self.scheduler.stop()
        self._io.shutdown(wait=False, cancel_futures=True)
        if self.redis is not None:
            self.redis.close()


def _load_tokenizer(model: str, allow_download: bool) -> Tokenizer:
    tokenizer_file = Path(model) / "tokenizer.json"
    if tokenizer_file.is_file():
        return Tokenizer.from_file(str(tokenizer_file))
    from transformers import AutoTokenizer  # a hub id: seconds to import, only when needed

    return AutoTokenizer.from_pretrained(model, local_files_only=not allow_download).backend_tokenizer


def _eos_ids(model: str, allow_download: bool) -> set[int]:
    """The EOS ids of config.json and generation_config.json: read as JSON from a model directory (as
    transformers reads them, without its seconds of import), through transformers for a hub id."""
    sources: list[object] = []
    directory = Path(model)
    if (directory / "config.json").is_file():
        for name in ("config.json", "generation_config.json"):
            if (directory / name).is_file():
                sources.append(json.loads((directory / name).read_text()).get("eos_token_id"))
    else:
        from transformers import AutoConfig, GenerationConfig

        sources.append(AutoConfig.from_pretrained(model, local_files_only=not allow_download).eos_token_id)
        try:
            sources.append(GenerationConfig.from_pretrained(model, local_files_only=not allow_download).eos_token_id)
        except OSError:  # no generation_config.json
            pass
    eos: set[int] = set()
    for source in sources:
        if source is not None:
            eos.update(source if isinstance(source, list) else [int(source)])  # type: ignore[call-overload]
    return eos
