"""Prefix KV blocks across a tensor-parallel group: gathered to rank 0 for Redis, scattered back on import.

Redis holds a block in one layout whatever the TP degree: ``[layers, 2, kv_heads, block_tokens,
head_dim]`` with ALL the model's KV heads (``KVCache.read_block`` of a TP=1 worker), under the same
chain keys, so TP=1 and TP=N workers share blocks both ways. Rank r of N holds KV heads
``r*H/N .. (r+1)*H/N`` (``Shard.part``), so a full block is the ranks' slices concatenated along the
head axis in rank order.

* Export: rank 0 broadcasts ``("gather_kv", cache id, block ids)``; every rank reads its slices of
  those blocks and they meet in one gloo ``gather`` on rank 0, which writes full blocks to Redis.
* Import: only rank 0 talks to Redis (so no follower can see a different answer than the block
  tables rank 0 plans with); it broadcasts ``("scatter_kv", cache id, block ids)`` and one gloo
  ``scatter`` hands each rank its head slice, written into the same block ids.

Both are calls in the leader's broadcast order, so followers run them between the same forward calls
as rank 0: an imported block is written on every rank before any forward reads it, and an exported
block was written by forwards the followers already ran. Tensors cross the gloo group as bytes (any
dtype; CPU copies even when the cache lives on a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from services.gpu_worker.model import KVCache


class BlockGroup(Protocol):
    """The collectives this module needs (``tp.Group``); rank 0 is the root."""

    def gather(self, t: Tensor) -> list[Tensor] | None: ...

    def scatter(self, out: Tensor, parts: list[Tensor] | None) -> None: ...


def gather_blocks(group: BlockGroup, cache: KVCache, ids: Sequence[int]) -> list[Tensor] | None:
    """Every rank: contribute this rank's slices of blocks ``ids``; rank 0 gets the full-head blocks (CPU)."""
    local = torch.stack([cache.read_block(b) for b in ids]).cpu()  # [n, layers, 2, local_kv, bt, d]
    parts = group.gather(local.view(torch.uint8))
    if parts is None:
        return None
    full = torch.cat([p.view(local.dtype) for p in parts], dim=3)
    return list(full.unbind(0))


def head_slices(blocks: Sequence[Tensor], dtype: torch.dtype, world: int) -> list[Tensor]:
    """Rank 0, before it announces a scatter: full-head ``blocks`` as ``world`` byte parts, rank r's heads in part r."""
    full = torch.stack([b.to(dtype) for b in blocks]).cpu()  # [n, layers, 2, kv_heads, bt, d]
    if full.shape[3] % world:
        raise ValueError(f"a KV block with {full.shape[3]} heads does not split over {world} ranks")
    return [c.contiguous().view(torch.uint8) for c in full.chunk(world, dim=3)]


def scatter_blocks(group: BlockGroup, cache: KVCache, ids: Sequence[int], parts: list[Tensor] | None) -> None:
    """Every rank: write this rank's part (``head_slices``, given on rank 0 only) into blocks ``ids``."""
    dtype = cache.k[0].dtype
    layers, (_, local_kv, head_dim) = len(cache.k), cache.k[0].shape
    out = torch.empty((len(ids), layers, 2, local_kv, cache.block_tokens, head_dim), dtype=dtype)
    group.scatter(out.view(torch.uint8), parts)
    for block, data in zip(ids, out.unbind(0), strict=True):
        cache.write_block(block, data)


class KVBlockIO(Protocol):
    """How the engine moves full-head blocks in and out of its cache (``tp.Leader`` under TP)."""

    def read_blocks(self, cache: KVCache, ids: Sequence[int]) -> list[Tensor]: ...

    def write_blocks(self, cache: KVCache, ids: Sequence[int], blocks: Sequence[Tensor]) -> None: ...


class LocalBlocks:
    """Block I/O of a worker with one rank (the engine's default): its cache holds every head."""

    def read_blocks(self, cache: KVCache, ids: Sequence[int]) -> list[Tensor]:
        return [cache.read_block(b).cpu() for b in ids]

    def write_blocks(self, cache: KVCache, ids: Sequence[int], blocks: Sequence[Tensor]) -> None:
        for block, data in zip(ids, blocks, strict=True):
            cache.write_block(block, data)
