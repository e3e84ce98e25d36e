from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

import pytest
from redis.crc import key_slot

from services.common.sampling import SamplingParams
from services.store.keys import (
    RESPONSE_PREFIX,
    Kind,
    kv_block_keys,
    response_key,
    response_pattern,
    scan_pattern,
    scope_of,
)


def key(**over: Any) -> str:
    args: dict[str, Any] = dict(
        model_id="m",
        model_version="v1",
        tier="edge",
        tokenizer_id="tok",
        sampling=SamplingParams(max_tokens=16),
        prompt_ids=[1, 2, 3],
        tenant="acme",
        shareable=False,
    )
    args.update(over)
    return response_key(**args)


def test_namespaced_and_stable() -> None:
    k = key()
    assert k.startswith(f"{RESPONSE_PREFIX}m|") and k.startswith("meshserve:v1:{r|m|")
    assert k == key()
    assert len(k.rsplit(":", 1)[1]) == 64
    assert "acme" not in k  # tenants appear only as a digest
    assert fnmatchcase(k, response_pattern("m")) and not fnmatchcase(k, response_pattern("other"))


def test_scan_patterns_select_tenant_model_and_version() -> None:
    k = key()
    assert fnmatchcase(k, scan_pattern(tenant="acme"))
    assert not fnmatchcase(k, scan_pattern(tenant="acm"))
    assert fnmatchcase(k, scan_pattern(Kind.RESPONSE, "m", "v1"))
    assert not fnmatchcase(k, scan_pattern(Kind.RESPONSE, "m", "v2"))
    assert not fnmatchcase(k, scan_pattern(Kind.KV))
    shared = key(shareable=True)
    assert fnmatchcase(shared, scan_pattern(shareable=True)) and not fnmatchcase(shared, scan_pattern(tenant="acme"))
    odd = key(model_id="weird{model}*")
    assert "{model}" not in odd and odd.count("{") == 1  # unsafe ids become digests: one hash tag


def test_entry_and_ledger_share_one_cluster_slot() -> None:
    k = key()
    assert len({key_slot(x.encode()) for x in (k, *scope_of(k))}) == 1


def chain(**over: Any) -> list[str]:
    args: dict[str, Any] = dict(
        model_id="m", model_version="v1", tenant="acme", token_ids=list(range(40)), block_tokens=8
    )
    args.update(over)
    return kv_block_keys(**args)


def test_kv_chain_keys() -> None:
    keys = chain()
    assert len(keys) == 5 and len(set(keys)) == 5
    assert chain(token_ids=list(range(43))) == keys  # trailing partial block has no key
    # a block key names its whole prefix: same first block, different second block
    other = chain(token_ids=[*range(8), *range(100, 132)])
    assert other[0] == keys[0] and other[1] != keys[1]
    assert len({key_slot(k.encode()) for k in (*keys, *scope_of(keys[0]))}) == 1
    assert chain(tenant="b")[0] != keys[0] and chain(model_version="v2")[0] != keys[0]
    assert chain(tenant="a", shareable=True) == chain(tenant="b", shareable=True)
    with pytest.raises(ValueError):
        chain(block_tokens=0)


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "other"},
        {"model_version": "v2"},
        {"tier": "cloud"},
        {"tokenizer_id": "tok2"},
        {"prompt_ids": [1, 2, 4]},
        {"prompt_ids": [1, 2, 3, 0]},
        {"sampling": SamplingParams(max_tokens=17)},
        {"sampling": SamplingParams(max_tokens=16, stop=("x",))},
        {"sampling": SamplingParams(max_tokens=16, temperature=0.5, seed=1)},
    ],
)
def test_every_input_changes_the_key(change: dict[str, Any]) -> None:
    assert key(**change) != key()


def test_each_tier_has_its_own_entry_in_the_same_scope() -> None:
    """Edge (INT4 student) and cloud (teacher) run different weights under one model id: one request
    has one answer per tier, so the tier is in the entry hash; the scope (flush, ledger, slot) is shared."""
    edge, cloud = key(tier="edge"), key(tier="cloud")
    assert edge != cloud
    assert edge == key(tier="edge") and cloud == key(tier="cloud")
    assert key(tier="cloud", shareable=True) != key(tier="edge", shareable=True)
    assert scope_of(edge) == scope_of(cloud)
    assert edge.rsplit(":", 1)[0] == cloud.rsplit(":", 1)[0]  # same hash tag: same Cluster slot
    assert key(model_version="v1e", tier="dge") != key(model_version="v1", tier="edge")


def test_tier_is_required() -> None:
    with pytest.raises(ValueError, match="tier is empty"):
        key(tier="")


def test_tenant_salt_unless_shareable() -> None:
    assert key(tenant="a") != key(tenant="b")
    assert key(tenant="a", shareable=True) == key(tenant="b", shareable=True)
    assert key(tenant="a", shareable=True) != key(tenant="a")


def test_no_field_boundary_collisions() -> None:
    assert key(model_id="ab", model_version="c") != key(model_id="a", model_version="bc")
