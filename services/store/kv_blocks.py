"""KV prefix blocks on Redis: chained block keys, one-round-trip store/load, byte budgets.

A prompt is split into ``block_tokens``-sized blocks; block i's key hashes block i-1's key, its
tokens, the model id/version and the tenant salt (keys.kv_block_keys), so a key names a whole
prefix and tenants never share a block unless the request marks its prefix shareable. All blocks of
one scope share a hash tag, so a chain is one MGET (load), one script (store: entries + byte ledger,
see ledger.py) or one script (longest-prefix length) even on Redis Cluster.

Values are kv_codec blocks (fp16/bf16 + versioned header + CRC). A missing, corrupt or foreign
block ends the usable chain there; it is counted, never trusted. Like the response cache this store
fails open: Redis down or slow gives an empty match and a store of 0 blocks, never an exception.
Encoding and copying decodes of large transfers run in a thread so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import structlog

from services.store.guard import Failed, Guard
from services.store.keys import kv_block_keys
from services.store.kv_codec import FP16, Tensor, decode_block, encode_block_view
from services.store.ledger import prefix_len_script, put_entries
from services.store.response_codec import CorruptEntry

log = structlog.get_logger(__name__)
KIND = "kv"
_THREAD_BYTES = 256 << 10
"""Transfers above this many bytes are encoded/decoded off the event loop."""
LOCATE_MAX_BLOCKS = 512
"""Most leading blocks :meth:`KVBlockStore.leading_blocks` looks for in one call (its default cap)."""


@dataclass(frozen=True)
class KVContext:
    """Whose blocks: the model (id + version) and the tenant, or shared across tenants."""

    model_id: str
    model_version: str
    tenant: str
    shareable: bool = False


class KVBlockStore:
    """Store and load per-block KV tensors of prompt prefixes (see the module docstring)."""

    def __init__(
        self,
        guard: Guard,
        *,
        block_tokens: int = 16,
        ttl_s: int = 3600,
        max_block_bytes: int = 4 << 20,
        budget_bytes: int = 256 << 20,
        timeout_s: float = 0.5,
    ) -> None:
        if block_tokens <= 0:
            raise ValueError("block_tokens must be positive")
        self.guard = guard
        self.block_tokens = block_tokens
        self.ttl_s = ttl_s
        self.max_block_bytes = max_block_bytes
        self.budget_bytes = budget_bytes
        """Most value bytes one scope (model version x tenant salt) may hold; soonest-expiring go first."""
        self.timeout_s = timeout_s

    def keys(self, ctx: KVContext, token_ids: Sequence[int]) -> list[str]:
        """Chain keys of the full blocks of ``token_ids``."""
        return kv_block_keys(
            model_id=ctx.model_id,
            model_version=ctx.model_version,
            tenant=ctx.tenant,
            token_ids=token_ids,
            block_tokens=self.block_tokens,
            shareable=ctx.shareable,
        )

    async def put(
        self, ctx: KVContext, token_ids: Sequence[int], blocks: Sequence[Tensor], first_block: int = 0
    ) -> int:
        """Store ``blocks`` as chain positions ``first_block``, ``first_block + 1``, ...

        Returns how many leading blocks were stored: a block too large for ``max_block_bytes`` or the
        budget, or a chain shorter than ``blocks``, ends the store there (a gap would be useless).
        """
        keys = self.keys(ctx, token_ids)[first_block : first_block + len(blocks)]
        blocks = blocks[: len(keys)]
        if not keys or not self.guard.enabled:
            return 0
        values = await self._encode(blocks)
        fits = 0
        for value in values:
            if len(value) > self.max_block_bytes:
                self.guard.count(KIND, "too_large", store=True)
                break
            fits += 1
        if fits == 0:
            return 0
        result = await self.guard.run(
            "kv_put",
            lambda c: put_entries(c, keys[:fits], values[:fits], self.ttl_s, self.budget_bytes),
            timeout_s=self.timeout_s,
        )
        if isinstance(result, Failed):
            self.guard.count(KIND, "error", store=True)
            return 0
        stored = int(result[0])  # type: ignore[index]
        self.guard.count(KIND, "stored", stored, store=True)
        if stored < fits:
            self.guard.count(KIND, "over_budget", fits - stored, store=True)
        return stored

    async def match(self, ctx: KVContext, token_ids: Sequence[int]) -> int:
        """How many leading blocks of ``token_ids`` are in Redis (no tensor bytes move)."""
        keys = self.keys(ctx, token_ids)
        if not keys:
            return 0
        n = await self.guard.run("kv_match", lambda c: prefix_len_script(c, keys, ()))
        if isinstance(n, Failed):
            self.guard.count(KIND, "error")
            return 0
        return int(n)  # type: ignore[call-overload]

    async def leading_blocks(
        self, ctx: KVContext, token_ids: Sequence[int], limit: int = LOCATE_MAX_BLOCKS
    ) -> int | None:
        """How many leading full blocks of ``token_ids`` Redis holds for ``ctx``, looking at most at
        ``limit``; None when that is unknown (no Redis configured, Redis down or slower than
        ``timeout_s``, breaker open). Never raises on a Redis problem.

        One round trip: a script EXISTS-es the chain keys in order and stops at the first missing one
        (a block after a gap cannot be used). No tensor bytes move and no hit/miss is counted: this
        answers an operator's question (``RouterAdmin.PrefixLocation``), it is not a lookup.
        """
        keys = self.keys(ctx, token_ids[: max(0, limit) * self.block_tokens])
        if not keys:
            return 0
        n = await self.guard.run("kv_locate", lambda c: prefix_len_script(c, keys, ()), timeout_s=self.timeout_s)
        return None if isinstance(n, Failed) else int(n)  # type: ignore[call-overload]

    async def load(
        self, ctx: KVContext, token_ids: Sequence[int], as_: Literal["numpy", "torch"] = "numpy"
    ) -> list[Tensor]:
        """The longest chain of valid stored blocks for ``token_ids`` (one MGET), maybe empty."""
        keys = self.keys(ctx, token_ids)
        if not keys:
            return []
        raw = await self.guard.run("kv_load", lambda c: c.mget(keys), timeout_s=self.timeout_s)
        if isinstance(raw, Failed):
            self.guard.count(KIND, "error")
            return []
        values: list[bytes] = []
        for v in raw:  # type: ignore[union-attr]
            if v is None:
                break
            values.append(v if isinstance(v, bytes) else str(v).encode())
        blocks, corrupt = await self._decode(values, as_)
        self.guard.count(KIND, "hit", len(blocks))
        if len(blocks) < len(keys):
            self.guard.count(KIND, "corrupt" if corrupt else "miss", len(keys) - len(blocks))
        return blocks

    async def _encode(self, blocks: Sequence[Tensor]) -> list[memoryview]:
        size = sum(int(getattr(b, "nbytes", 0)) for b in blocks)
        if size > _THREAD_BYTES:
            return await asyncio.to_thread(lambda: [encode_block_view(b) for b in blocks])
        return [encode_block_view(b) for b in blocks]

    async def _decode(self, values: list[bytes], as_: Literal["numpy", "torch"]) -> tuple[list[Tensor], bool]:
        def run() -> tuple[list[Tensor], bool]:
            out: list[Tensor] = []
            for v in values:
                try:
                    out.append(decode_block(v, as_))
                except CorruptEntry as exc:
                    log.warning("cache_corrupt_entry", kind=KIND, error=str(exc))
                    return out, True
            return out, False

        # numpy fp16 blocks decode to views of the values (no copy: cheaper than a thread hop);
        # torch and bf16 blocks are copied, which for a large transfer moves off the event loop.
        copies = as_ == "torch" or any(len(v) > 5 and v[5] != FP16 for v in values)
        if copies and sum(len(v) for v in values) > _THREAD_BYTES:
            return await asyncio.to_thread(run)
        return run()
