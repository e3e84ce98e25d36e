"""A prompt's prefix blocks as the router names them: the KV cache's own block hashes
(``services.store.keys.kv_block_hashes``), so they equal the hashes workers report as hot."""

from __future__ import annotations

from collections.abc import Sequence

from services.store.keys import kv_block_hashes


def prefix_blocks(
    token_ids: Sequence[int],
    block_tokens: int,
    *,
    model_id: str = "",
    model_version: str = "",
    tenant: str = "",
    shareable: bool = False,
) -> list[bytes]:
    """Chained hashes of the prompt's full blocks (block i's covers blocks 0..i), as the KV cache names
    them: the same model, version and tenant salt give the hashes workers report as hot."""
    return kv_block_hashes(
        model_id=model_id,
        model_version=model_version,
        tenant=tenant,
        token_ids=token_ids,
        block_tokens=block_tokens,
        shareable=shareable,
    )


def block_hashes(token_ids: Sequence[int], block_tokens: int, salt: str = "") -> list[bytes]:
    """:func:`prefix_blocks` salted with ``salt`` as the tenant ("" = shareable), no model (simulations)."""
    return prefix_blocks(token_ids, block_tokens, tenant=salt, shareable=not salt)
