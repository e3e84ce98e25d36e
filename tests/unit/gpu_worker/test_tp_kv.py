"""Prefix KV blocks across TP ranks with fake collectives: gathered and scattered blocks equal TP=1's layout.

The real gloo group runs in tests/integration/gpu_worker/test_tp.py (a TP=3 worker sharing prefixes
with a TP=1 engine through Redis); here the head-slice bookkeeping is checked exactly and fast.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from services.gpu_worker.model import KVCache
from services.gpu_worker.tp_kv import LocalBlocks, gather_blocks, head_slices, scatter_blocks

LAYERS, HEADS, DIM, BT, BLOCKS, WORLD = 2, 3, 4, 2, 4, 3


def full_cache(dtype: torch.dtype = torch.float16) -> KVCache:
    """A TP=1 cache with every head, filled with distinct values."""
    slots = BLOCKS * BT
    shape = (slots, HEADS, DIM)
    base = torch.arange(slots * HEADS * DIM, dtype=torch.float32).view(shape)
    k = [(base + 1000 * layer).to(dtype) for layer in range(LAYERS)]
    v = [(-base - 1000 * layer).to(dtype) for layer in range(LAYERS)]
    return KVCache(k=k, v=v, block_tokens=BT)


def rank_cache(full: KVCache, rank: int) -> KVCache:
    """Rank ``rank``'s cache: its contiguous slice of the KV heads (Shard.part)."""
    h = HEADS // WORLD
    heads = slice(rank * h, (rank + 1) * h)
    return KVCache(k=[t[:, heads].clone() for t in full.k], v=[t[:, heads].clone() for t in full.v], block_tokens=BT)


def empty_like(cache: KVCache) -> KVCache:
    return KVCache(k=[torch.zeros_like(t) for t in cache.k], v=[torch.zeros_like(t) for t in cache.v], block_tokens=BT)


class Follower:
    """A follower's side of the group: records what it gathers, receives what rank 0 scattered to it."""

    def __init__(self, inbox: Tensor | None = None) -> None:
        self.sent: Tensor | None = None
        self.inbox = inbox

    def gather(self, t: Tensor) -> list[Tensor] | None:
        self.sent = t.clone()
        return None

    def scatter(self, out: Tensor, parts: list[Tensor] | None) -> None:
        assert parts is None and self.inbox is not None
        out.copy_(self.inbox)


class Root:
    """Rank 0's side: the followers' gathered bytes come from ``others``; scattered parts are kept."""

    def __init__(self, others: list[Tensor] | None = None) -> None:
        self.others = others or []
        self.parts: list[Tensor] = []

    def gather(self, t: Tensor) -> list[Tensor] | None:
        return [t, *self.others]

    def scatter(self, out: Tensor, parts: list[Tensor] | None) -> None:
        assert parts is not None and len(parts) == WORLD
        self.parts = parts
        out.copy_(parts[0])


def test_gathered_blocks_are_the_tp1_blocks_with_every_head() -> None:
    full = full_cache()
    ranks = [rank_cache(full, r) for r in range(WORLD)]
    ids = [3, 1]
    followers = [Follower() for _ in range(1, WORLD)]
    for group, cache in zip(followers, ranks[1:], strict=True):
        assert gather_blocks(group, cache, ids) is None
    sent = [g.sent for g in followers]
    assert all(t is not None for t in sent)
    blocks = gather_blocks(Root([t for t in sent if t is not None]), ranks[0], ids)
    assert blocks is not None and len(blocks) == 2
    for block, data in zip(ids, blocks, strict=True):
        assert data.shape == (LAYERS, 2, HEADS, BT, DIM) and data.dtype == torch.float16
        assert torch.equal(data, full.read_block(block))


def test_scattered_blocks_give_each_rank_its_head_slice() -> None:
    full = full_cache()
    blocks = [full.read_block(b).float() for b in (0, 2)]  # Redis may hold another dtype: cast to the cache's
    ids = [1, 3]
    ranks = [empty_like(rank_cache(full, r)) for r in range(WORLD)]
    root = Root()
    scatter_blocks(root, ranks[0], ids, head_slices(blocks, torch.float16, WORLD))
    for rank in range(1, WORLD):
        scatter_blocks(Follower(root.parts[rank]), ranks[rank], ids, None)
    expected = empty_like(full)
    LocalBlocks().write_blocks(expected, ids, blocks)
    for rank in range(WORLD):
        assert all(torch.equal(a, b) for a, b in zip(ranks[rank].k, rank_cache(expected, rank).k, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(ranks[rank].v, rank_cache(expected, rank).v, strict=True))
    assert torch.equal(LocalBlocks().read_blocks(expected, [1])[0], blocks[0].half())


def test_a_block_whose_heads_do_not_split_over_the_ranks_is_refused_before_any_collective() -> None:
    wrong = [full_cache().read_block(0)[:, :, :2]]  # 2 heads over 3 ranks
    with pytest.raises(ValueError, match="2 heads does not split over 3 ranks"):
        head_slices(wrong, torch.float16, WORLD)
