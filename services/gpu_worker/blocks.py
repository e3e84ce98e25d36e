"""KV block accounting: allocation, reference counts and the local prefix LRU (one lock).

The KV cache is ``num_blocks`` fixed-size token blocks (``block_tokens``, the same block size as the
Redis KV prefix cache: docs/cloud.md, *KV cache and prefix reuse*). A block is *used* while a live
sequence references it.
A full block whose tokens are final gets its chain key (services.store.keys.kv_block_keys: the
hash of the whole prefix up to it, model version and tenant salt); when its last user releases it
it stays in the cache as an evictable *cached* block, reusable by any later sequence whose prompt
starts with the same prefix, until allocation needs the space (least recently used first).
Several sequences may share a cached block; blocks are never written after they are full, so
sharing needs no copy.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


class BlockUsage(NamedTuple):
    """KV memory now: bytes referenced by live sequences and the budget."""

    used_bytes: int
    budget_bytes: int
    cached_bytes: int
    """Bytes of unreferenced prefix blocks kept for reuse (evicted when space is needed)."""


@dataclass
class BlockInfo:
    """One KV block's bookkeeping: its prefix key (None while private), references, export state, last use."""

    key: str | None = None
    refs: int = 0
    exported: bool = False
    last_used: float = 0.0


class BlockManager:
    """Thread-safe block allocator with prefix sharing (see the module docstring)."""

    def __init__(self, num_blocks: int, block_tokens: int, bytes_per_block: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV budget holds no block; raise kv_budget_bytes")
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self.bytes_per_block = bytes_per_block
        self.lock = threading.Lock()
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._blocks = [BlockInfo() for _ in range(num_blocks)]
        self._by_key: dict[str, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached (hashed, unreferenced), oldest first
        self.evicted_total = 0

    # All methods below expect ``self.lock`` to be held by the caller unless they say otherwise.

    @property
    def available(self) -> int:
        """Blocks an allocation can get now (free + evictable)."""
        return len(self._free) + len(self._lru)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free) - len(self._lru)

    def usage(self) -> BlockUsage:
        with self.lock:
            b = self.bytes_per_block
            return BlockUsage(self.used * b, self.num_blocks * b, len(self._lru) * b)

    def cached_prefix(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` are cached now (no reference taken)."""
        n = 0
        for key in keys:
            if key not in self._by_key:
                break
            n += 1
        return n

    def acquire_prefix(self, keys: Sequence[str]) -> list[int]:
        """Reference the cached blocks of the longest cached prefix of ``keys``; their ids."""
        now = time.monotonic()
        out: list[int] = []
        for key in keys:
            block = self._by_key.get(key)
            if block is None:
                break
            info = self._blocks[block]
            if info.refs == 0:
                self._lru.pop(block, None)
            info.refs += 1
            info.last_used = now
            out.append(block)
        return out

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks (evicting cached ones, oldest first), or None if fewer are available."""
        if n > self.available:
            return None
        out: list[int] = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._lru.popitem(last=False)
                info = self._blocks[block]
                if info.key is not None and self._by_key.get(info.key) == block:
                    del self._by_key[info.key]
                self._blocks[block] = BlockInfo()
                self.evicted_total += 1
            self._blocks[block].refs = 1
            out.append(block)
        return out

    def share(self, blocks: Sequence[int]) -> None:
        """One more reference to each of ``blocks`` (held already): a forked sequence shares them."""
        for block in blocks:
            self._blocks[block].refs += 1

    def register(self, block: int, key: str, exported: bool = False) -> None:
        """Name a full block by its chain key so later prompts can share it (first holder wins)."""
        info = self._blocks[block]
        if info.key is not None:
            return
        if key in self._by_key:
            return  # the same prefix is already cached in another block; this one stays private
        info.key = key
        info.exported = exported
        self._by_key[key] = block

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block; unreferenced named blocks become cached, others free."""
        now = time.monotonic()
        for block in blocks:
            info = self._blocks[block]
            info.refs -= 1
            if info.refs > 0:
                continue
            info.last_used = now
            if info.key is not None:
                self._lru[block] = None
                self._lru.move_to_end(block)
            else:
                self._blocks[block] = BlockInfo()
                self._free.append(block)

    def key_of(self, block: int) -> str | None:
        return self._blocks[block].key

    def exported(self, block: int) -> bool:
        return self._blocks[block].exported

    def mark_exported(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self._blocks[block].exported = True

    def is_cached(self, key: str) -> bool:
        return key in self._by_key
