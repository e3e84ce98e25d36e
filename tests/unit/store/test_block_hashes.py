from __future__ import annotations

from services.store.keys import kv_block_hashes, kv_block_keys

SCOPE = {"model_id": "m", "model_version": "v1", "tenant": "acme", "block_tokens": 4}


def test_block_hashes_are_the_digests_inside_the_kv_keys() -> None:
    tokens = list(range(10))
    hashes = kv_block_hashes(token_ids=tokens, **SCOPE)
    keys = kv_block_keys(token_ids=tokens, **SCOPE)
    assert len(hashes) == 2  # the partial third block has no hash
    assert [k.rsplit(":e:", 1)[1] for k in keys] == [h.hex() for h in hashes]


def test_block_hashes_chain_scope_and_limit() -> None:
    a = kv_block_hashes(token_ids=list(range(12)), **SCOPE)
    assert kv_block_hashes(token_ids=[*range(8), 0, 0, 0, 0], **SCOPE)[:2] == a[:2]
    assert kv_block_hashes(token_ids=[9, *range(1, 12)], **SCOPE)[2] != a[2]  # a changed parent changes all
    assert kv_block_hashes(token_ids=list(range(12)), **{**SCOPE, "tenant": "other"}) != a
    assert kv_block_hashes(token_ids=list(range(12)), **{**SCOPE, "model_version": "v2"}) != a
    shared = kv_block_hashes(token_ids=list(range(12)), shareable=True, **SCOPE)
    assert shared == kv_block_hashes(token_ids=list(range(12)), shareable=True, **{**SCOPE, "tenant": "x"})
    assert kv_block_hashes(token_ids=list(range(12)), limit=2, **SCOPE) == a[:2]
