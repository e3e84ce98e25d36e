"""Tensor parallelism: rank 0 leads, the other ranks of the group follow its model calls.

A cloud worker of TP degree N is N processes started by torchrun (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` in the environment)::

    torchrun --standalone --nnodes=1 --nproc-per-node=3 --no-python meshserve serve gpu-worker

Every rank loads its head/MLP slice of the model (``LlamaModel.load(shard=Shard(rank, world),
all_reduce=...)``, see ``model.py``). Rank 0 is the normal worker (gRPC, scheduler, sampling); its
model calls go through a :class:`Leader`, which, before each call that touches the shards
(``new_cache``, ``forward``), broadcasts it to the followers (``LeaderModel`` wraps a model with it).
Followers run :func:`follow`: receive a call, make the same call on their shard, repeat
until told to stop. Tensor results meet in the model's ``all_reduce`` (sum after o_proj and
down_proj), so every rank computes identical logits; only rank 0 looks at them.
Prefix KV for Redis crosses the group the same way: ``gather_kv`` (export: the ranks' head slices
of full blocks meet on rank 0) and ``scatter_kv`` (import: rank 0 hands each rank its slice); the
blocks in Redis always hold every head, as a TP=1 worker writes them (``tp_kv.py``).

Sleep (services/worker/sleep.py): rank 0's engine releases its shard and KV and sends ``release``:
every follower drops its shard and caches and trims its heap. A wake sends ``restore`` first, so the
followers load their shards while rank 0 loads its own; the engine's new cache is then shared again as
call id 0 (:meth:`Leader.share_cache`). A follower that cannot load its shard exits 1 (torchrun then
ends the group and the supervisor restarts it, as for any follower failure).

Transport: the model's all-reduce runs on the default process group (NCCL with CUDA tensors on
``cuda:LOCAL_RANK``, gloo on CPU); call messages (token ids, starts, block tables: small Python
objects) go through ``broadcast_object_list`` on a gloo group, so they never touch the GPU.

Failure handling, so that no rank hangs:

* every collective has the process group's timeout (``tp_timeout_s``); an idle leader sends a
  ``ping`` every third of it so idle followers do not time out;
* the leader sends ``stop`` when the worker shuts down (also at interpreter exit); followers then
  leave the group and exit 0. Followers ignore SIGTERM/SIGINT (torchrun and Ctrl-C signal every
  rank) because in-flight steps still need them while rank 0 drains;
* a call that fails the same way on every rank (a bad step plan: ``ValueError``) fails on the
  leader and is skipped by followers; any other failure on a follower, or a broken group, ends the
  follower with exit status 1, which makes torchrun tear the whole group down (rank 0 included) so
  a supervisor restarts it instead of leaving a half-dead group serving.

Why our own sharding and not transformers' ``tp_plan="auto"``: the engine runs our own
``LlamaModel`` over a paged KV cache (``model.py`` says why), and sharding it by heads costs two
all-reduces per layer, the same as Megatron-style ``tp_plan``.
"""

from __future__ import annotations

import atexit
import gc
import signal
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch import Tensor

from services.common.config import load_settings
from services.common.errors import ConfigError
from services.common.logging import configure_logging
from services.gpu_worker.config import GpuWorkerSettings
from services.gpu_worker.engine import resolve_device, resolve_dtype
from services.gpu_worker.model import KVCache, LlamaModel, Shard
from services.gpu_worker.packed import limit_primitive_cache
from services.gpu_worker.plan import Segment
from services.gpu_worker.tp_env import RankEnv, check_degree, device_for, model_config
from services.gpu_worker.tp_kv import gather_blocks, head_slices, scatter_blocks
from services.worker.sleep import HostMemory

__all__ = [
    "Group",
    "Leader",
    "LeaderModel",
    "RankEnv",
    "check_degree",
    "device_for",
    "follow",
    "load_model",
    "model_config",
]

Forward = Callable[[Sequence[Segment]], list[Tensor]]

log = structlog.get_logger(__name__)

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}


class Group:
    """The process group of one TP worker: all-reduce for the model, a gloo group for call messages."""

    def __init__(self, env: RankEnv, device: torch.device, *, timeout_s: float) -> None:
        self.env = env
        self.timeout_s = timeout_s
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            kwargs["device_id"] = device
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=env.rank,
            world_size=env.world,
            timeout=timedelta(seconds=timeout_s),
            **kwargs,
        )
        self._control = None
        if backend != "gloo":  # call messages stay on the CPU
            self._control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        log.info("tp_group_ready", rank=env.rank, world=env.world, backend=backend, device=str(device))

    def all_reduce(self, t: Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)

    def send(self, message: tuple[Any, ...]) -> None:
        """Leader: broadcast one call message to the followers."""
        dist.broadcast_object_list([message], src=0, group=self._control)

    def receive(self) -> tuple[Any, ...]:
        """Follower: the next call message from the leader (blocks up to the group's timeout)."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self._control)
        return tuple(box[0])

    def gather(self, t: Tensor) -> list[Tensor] | None:
        """Every rank sends ``t`` (CPU, same shape everywhere); rank 0 gets them in rank order."""
        parts = [torch.empty_like(t) for _ in range(self.env.world)] if self.env.leader else None
        dist.gather(t, parts, dst=0, group=self._control)
        return parts

    def scatter(self, out: Tensor, parts: list[Tensor] | None) -> None:
        """Rank r receives ``parts[r]`` (given on rank 0 only) into ``out`` (CPU)."""
        dist.scatter(out, parts, src=0, group=self._control)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _segments_message(segments: Sequence[Segment]) -> list[tuple[list[int], int, list[int], bool]]:
    return [(list(s.token_ids), s.start, list(s.block_table), s.all_logits) for s in segments]


class Leader:
    """Rank 0's side of the group: mirrors model calls on the followers (see the module docstring).

    Calls are serialized by one lock (followers run them in broadcast order), so the engine loop and
    the KV transfers' threads may call concurrently. An idle leader pings every ``keepalive_s``.
    """

    def __init__(self, group: Group, *, keepalive_s: float | None = None) -> None:
        self.group = group
        self.shard = Shard(group.env.rank, group.env.world)
        self.lock = threading.Lock()
        self._next_cache = 0
        self._closed = False
        self._last_send = time.monotonic()
        self._keepalive_s = keepalive_s if keepalive_s is not None else max(group.timeout_s / 3, 0.5)
        self._stop_keepalive = threading.Event()
        self._keepalive = threading.Thread(target=self._ping_forever, name="tp-keepalive", daemon=True)
        self._keepalive.start()
        atexit.register(self.close)

    def all_reduce(self, t: Tensor) -> None:
        self.group.all_reduce(t)

    def _send(self, *message: Any) -> None:
        if self._closed:
            raise RuntimeError("the tensor-parallel group is closed")
        self.group.send(message)
        self._last_send = time.monotonic()

    def share_cache(self, cache: KVCache) -> KVCache:
        """Have every follower allocate a cache like ``cache`` (tagged with an id for later calls)."""
        with self.lock:
            cid = self._next_cache
            self._next_cache += 1
            blocks = cache.k[0].shape[0] // cache.block_tokens
            self._send("new_cache", cid, blocks, cache.block_tokens, _DTYPE_NAMES[cache.k[0].dtype])
        cache.tp_id = cid  # type: ignore[attr-defined]
        return cache

    def free_cache(self, cache: KVCache) -> None:
        with self.lock:
            if not self._closed:
                self._send("free_cache", cache.tp_id)  # type: ignore[attr-defined]

    def release(self) -> None:
        """The followers drop their shards and caches (rank 0's engine has dropped its own): a sleep.
        The next shared cache is id 0 again (the engine's, after :meth:`restore`)."""
        with self.lock:
            self._send("release")
            self._next_cache = 0

    def restore(self) -> None:
        """The followers load their shards again, while rank 0 loads its own; then the engine shares its
        new cache (:meth:`share_cache`) before the first step."""
        with self.lock:
            self._send("restore")

    def forward(self, model: LlamaModel, segments: Sequence[Segment], cache: KVCache) -> list[Tensor]:
        """``model.forward(segments, cache)`` on every rank; the leader's logits."""
        with self.lock:
            self._send("forward", cache.tp_id, _segments_message(segments))  # type: ignore[attr-defined]
            return model.forward(segments, cache)

    def read_blocks(self, cache: KVCache, ids: Sequence[int]) -> list[Tensor]:
        """Full-head copies of blocks ``ids`` of a shared cache, gathered from every rank (tp_kv.py)."""
        with self.lock:
            self._send("gather_kv", cache.tp_id, list(ids))  # type: ignore[attr-defined]
            blocks = gather_blocks(self.group, cache, ids)
        assert blocks is not None
        return blocks

    def write_blocks(self, cache: KVCache, ids: Sequence[int], blocks: Sequence[Tensor]) -> None:
        """Write full-head ``blocks`` into blocks ``ids``: each rank gets its head slice (tp_kv.py)."""
        parts = head_slices(blocks, cache.k[0].dtype, self.group.env.world)  # a bad block fails before the call
        with self.lock:
            self._send("scatter_kv", cache.tp_id, list(ids))  # type: ignore[attr-defined]
            scatter_blocks(self.group, cache, ids, parts)

    def wrap_forward(self, forward: Forward) -> Forward:
        """For ``CloudEngine(wrap_forward=...)``: its step function over its cache (the first one
        shared, id 0: call :meth:`share_cache` on it before the first step), mirrored first."""

        def run(segments: Sequence[Segment]) -> list[Tensor]:
            with self.lock:
                self._send("forward", 0, _segments_message(segments))
                return forward(segments)

        return run

    def _ping_forever(self) -> None:
        while not self._stop_keepalive.wait(self._keepalive_s / 2):
            if time.monotonic() - self._last_send < self._keepalive_s:
                continue
            with self.lock:
                if self._closed:
                    return
                try:
                    self._send("ping")
                except Exception as exc:  # a broken group: the next real call reports it
                    log.error("tp_keepalive_failed", error=str(exc))
                    return

    def close(self) -> None:
        """Tell the followers to stop and leave the group (idempotent)."""
        self._stop_keepalive.set()
        with self.lock:
            if self._closed:
                return
            try:
                self._send("stop")
            except Exception as exc:
                log.warning("tp_stop_failed", error=str(exc))
            self._closed = True
        self.group.close()


class LeaderModel:
    """Rank 0's model with ``LlamaModel``'s interface (``new_cache``, ``forward``), mirrored on followers."""

    def __init__(self, model: LlamaModel, leader: Leader) -> None:
        self.model = model
        self.leader = leader
        self.config = model.config
        self.shard = model.shard
        self.device = model.device
        self.dtype = model.dtype

    def new_cache(self, num_blocks: int, block_tokens: int, dtype: torch.dtype) -> KVCache:
        return self.leader.share_cache(self.model.new_cache(num_blocks, block_tokens, dtype))

    def free_cache(self, cache: KVCache) -> None:
        self.leader.free_cache(cache)

    def forward(self, segments: Sequence[Segment], cache: KVCache) -> list[Tensor]:
        return self.leader.forward(self.model, segments, cache)

    def close(self) -> None:
        self.leader.close()


def follow(model: LlamaModel | list[LlamaModel], group: Group, reload: Callable[[], LlamaModel] | None = None) -> None:
    """A follower's loop: mirror the leader's calls on this rank's shard until ``stop``; ``release``
    drops the shard, ``restore`` loads it again with ``reload`` (see the module docstring). A one-item
    list hands the shard over (emptied here), so the caller keeps no reference that a sleep cannot free."""
    caches: dict[int, KVCache] = {}
    shard: LlamaModel | None = model.pop() if isinstance(model, list) else model
    del model
    while True:
        message = group.receive()
        kind = message[0]
        if kind == "ping":
            continue
        if kind == "stop":
            return
        if kind == "release":
            if shard is not None:
                shard.packer.wait()  # its thread holds the weights until it is done
            shard = None
            caches.clear()
            gc.collect()
            HostMemory().trim()
            log.info("tp_follower_released", rank=group.env.rank)
            continue
        if kind == "restore":
            if reload is None:
                raise RuntimeError("this follower cannot load its shard again")
            if shard is None:
                started = time.perf_counter()
                shard = reload()
                log.info("tp_follower_restored", rank=group.env.rank, seconds=round(time.perf_counter() - started, 3))
            continue
        if shard is None:
            raise RuntimeError(f"tensor-parallel call {kind!r} while this rank's shard is released")
        if kind == "new_cache":
            _, cid, num_blocks, block_tokens, dtype = message
            caches[cid] = shard.new_cache(num_blocks, block_tokens, _DTYPES[dtype])
        elif kind == "free_cache":
            caches.pop(message[1], None)
        elif kind == "forward":
            _, cid, raw = message
            segments = [Segment(tokens, start, table, all_logits) for tokens, start, table, all_logits in raw]
            try:
                shard.forward(segments, caches[cid])
            except ValueError as exc:  # a bad plan fails before any collective, on the leader too
                log.warning("tp_step_rejected", error=str(exc))
        elif kind == "gather_kv":
            gather_blocks(group, caches[message[1]], message[2])
        elif kind == "scatter_kv":
            scatter_blocks(group, caches[message[1]], message[2], None)
        else:
            raise RuntimeError(f"unknown tensor-parallel call {kind!r}")


def load_model(
    path: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    env: RankEnv | None = None,
    timeout_s: float = 120.0,
    allow_download: bool = False,
) -> tuple[LlamaModel | LeaderModel, Group | None]:
    """This rank's model: a plain ``LlamaModel`` when the group has one rank, else its shard in a group.

    The TP degree is checked against the model before the group forms, so every rank fails fast with
    the same ConfigError. On rank 0 the model is a :class:`LeaderModel`; followers get the shard and
    the group to pass to :func:`follow`.
    """
    env = env or RankEnv.from_env()
    check_degree(model_config(path, allow_download=allow_download), env.world)
    if env.world == 1:
        return LlamaModel.load(path, device=device, dtype=dtype, allow_download=allow_download), None
    device = device_for(env, device)
    group = Group(env, device, timeout_s=timeout_s)
    model = LlamaModel.load(
        path,
        device=device,
        dtype=dtype,
        shard=Shard(env.rank, env.world),
        all_reduce=group.all_reduce,
        allow_download=allow_download,
    )
    if env.leader:
        return LeaderModel(model, Leader(group)), group
    return model, group


def run_follower(path: str, *, device: torch.device, dtype: torch.dtype, env: RankEnv, timeout_s: float) -> int:
    """A follower process: load the shard, follow rank 0 until ``stop``; returns the exit status."""
    for sig in (signal.SIGTERM, signal.SIGINT):  # rank 0 drains first and then sends stop
        signal.signal(sig, lambda *_: log.info("tp_follower_signal_ignored", rank=env.rank))
    model, group = load_model(path, device=device, dtype=dtype, env=env, timeout_s=timeout_s)
    assert group is not None and isinstance(model, LlamaModel)
    log.info("tp_follower_ready", rank=env.rank, world=env.world)

    on, shard = model.device, model.shard  # not the model itself: a sleep must free it

    def reload() -> LlamaModel:  # the same shard again, after a sleep
        return LlamaModel.load(path, device=on, dtype=dtype, shard=shard, all_reduce=group.all_reduce)

    handed = [model]
    del model
    try:
        follow(handed, group, reload)
    except Exception as exc:  # broken group or a failed step: end this rank so torchrun ends the group
        log.error("tp_follower_failed", rank=env.rank, error=str(exc))
        return 1
    finally:
        group.close()
    log.info("tp_follower_stopped", rank=env.rank)
    return 0


def start_leader(settings: GpuWorkerSettings) -> Leader | None:
    """Rank 0 of a torchrun group of more than one rank: check the degree, join the group; else None."""
    env = RankEnv.from_env()
    if env.world == 1:
        return None
    path = settings.check_model()
    check_degree(model_config(path, allow_download=settings.allow_download), env.world)
    device = device_for(env, resolve_device(settings.device))
    return Leader(Group(env, device, timeout_s=settings.tp_timeout_s))


def follower_main(settings_cls: type[GpuWorkerSettings]) -> int:
    """``python -m services.gpu_worker`` on a rank > 0: follow rank 0; the process exit status."""
    try:
        settings = load_settings(settings_cls)
    except ConfigError as exc:
        configure_logging(settings_cls.service)
        log.error("config_error", error=str(exc))
        return 2
    configure_logging(settings_cls.service, settings.log_level, settings.log_json)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    limit_primitive_cache(settings.cpu_primitive_cache)
    env = RankEnv.from_env()
    try:
        path = settings.check_model()
        device = resolve_device(settings.device)
        dtype = resolve_dtype(settings.dtype, device)
        return run_follower(path, device=device, dtype=dtype, env=env, timeout_s=settings.tp_timeout_s)
    except ConfigError as exc:
        log.error("config_error", error=str(exc), rank=env.rank)
        return 2
