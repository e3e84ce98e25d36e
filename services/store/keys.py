"""Redis key schema of meshserve. No other module builds cache keys by hand (docs/cache.md).

Every cache key has the form::

    meshserve:v1:{<kind>|<model>|<version digest>|<scope digest>}:<suffix>

* ``meshserve:v1`` — namespace and schema version (bump it when a key or value layout changes
  incompatibly; old keys then simply expire).
* ``{...}`` — the Redis Cluster hash tag: everything of one *scope* (cache kind x model x model
  version x tenant salt) lives in one slot, so the multi-key operations we issue (MGET of a KV
  chain, the accounting script that writes an entry and its ledger) never cross slots.
* ``kind`` — ``r`` response cache, ``k`` KV prefix blocks.
* ``model`` — the model id when it is made of safe characters, else ``h`` + a digest; readable so an
  admin can flush one model with a SCAN.
* ``version digest`` — 12 hex of SHA-256(model version): flush by model version, and a new version
  never sees old entries.
* ``scope digest`` — 16 hex of SHA-256(tenant salt): the tenant id (never in clear) or the fixed
  marker for shareable prefixes.
* suffix ``e:<sha256>`` an entry (response or KV block), ``ix`` / ``sz`` / ``used`` the scope's
  byte ledger (see ledger.py).

Stored responses of ``POST /v1/responses`` (services/store/responses.py) are not cache entries: one
tenant's responses share the hash tag ``{s|<scope digest>}`` (the tenant never in clear), then
``:resp:<response id>``; :func:`stored_response_key` builds them.

Response entry hash (layout ``RESPONSE_LAYOUT`` = 2): SHA-256 over length-prefixed fields (the
layout marker ``response/2``, model id, version, serving tier, tokenizer fingerprint, canonical
sampling JSON (``SamplingParams.canonical()``), tenant salt, prompt ids as little-endian uint32).
The tier is there because the tiers run different weights under one model id (edge: the INT4
student; cloud: the teacher), so one request has one answer per tier. Layout 1 had no marker and
no tier: its entries are never read again and expire by TTL.
KV block hash (the vLLM chain): SHA-256(parent block hash, model id, version, tenant salt, block
tokens); the first block's parent is 32 zero bytes.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from services.common.sampling import SamplingParams

NAMESPACE = "meshserve:v1"
RESPONSE_LAYOUT = 2
"""Layout of the response entry hash; bump it when its fields change (old entries then simply miss)."""
RESPONSE_PREFIX = f"{NAMESPACE}:{{r|"
STATS_KEY = f"{NAMESPACE}:{{stats}}:counters"
"""Hash of lookup/store counters by ``<kind>:<result>`` (flushed by every cache user)."""
_SAFE_MODEL = re.compile(r"^[A-Za-z0-9._/-]{1,64}$")
_ROOT = b"\0" * 32


class Kind(StrEnum):
    """Cache kinds; the value is the one-letter tag used in keys."""

    RESPONSE = "r"
    KV = "k"


def _field(h: hashlib._Hash, data: bytes) -> None:
    h.update(struct.pack("<Q", len(data)))
    h.update(data)


def tenant_salt(tenant: str, shareable: bool) -> bytes:
    """What separates tenants in a key: the tenant id, or a fixed marker for shareable prompts."""
    return b"shared" if shareable else b"tenant:" + tenant.encode()


def _digest(data: bytes, n: int) -> str:
    return hashlib.sha256(data).hexdigest()[:n]


def model_tag(model_id: str) -> str:
    """The model part of a key: the id itself when safe for keys and SCAN patterns, else a digest."""
    return model_id if _SAFE_MODEL.match(model_id) else "h" + _digest(model_id.encode(), 16)


def version_tag(model_version: str) -> str:
    return _digest(model_version.encode(), 12)


def scope_tag(tenant: str, shareable: bool) -> str:
    return _digest(tenant_salt(tenant, shareable), 16)


@dataclass(frozen=True)
class Scope:
    """One cache kind of one model version for one tenant salt: one hash tag, one slot, one ledger."""

    kind: Kind
    model_id: str
    model_version: str
    tenant: str
    shareable: bool = False

    @property
    def tag(self) -> str:
        return (
            f"{{{self.kind.value}|{model_tag(self.model_id)}|{version_tag(self.model_version)}"
            f"|{scope_tag(self.tenant, self.shareable)}}}"
        )

    @property
    def prefix(self) -> str:
        return f"{NAMESPACE}:{self.tag}"

    def entry(self, digest: str) -> str:
        return f"{self.prefix}:e:{digest}"

    @property
    def ledger(self) -> tuple[str, str, str]:
        """(index zset, sizes hash, used-bytes counter) of this scope."""
        p = self.prefix
        return f"{p}:ix", f"{p}:sz", f"{p}:used"


def response_key(
    *,
    model_id: str,
    model_version: str,
    tier: str,
    tokenizer_id: str,
    sampling: SamplingParams,
    prompt_ids: Sequence[int],
    tenant: str,
    shareable: bool = False,
    tools: str = "",
) -> str:
    """Redis key of the cached response to exactly this request (see the module docstring).

    ``tools``: a digest of a chat turn's tools and tool choice (services/router/tools.py); hashed in
    only when set, so the keys of requests without tools are unchanged.

    ``tier`` names the weights that produce the answer (``"edge"`` or ``"cloud"``): the router
    looks up under the tier its routing decision picks and stores under the tier that served.
    """
    if not tier:
        raise ValueError("tier is empty; pass the serving tier whose weights produce the answer, e.g. 'edge'")
    h = hashlib.sha256()
    _field(h, f"response/{RESPONSE_LAYOUT}".encode())
    _field(h, model_id.encode())
    _field(h, model_version.encode())
    _field(h, tier.encode())
    _field(h, tokenizer_id.encode())
    _field(h, json.dumps(sampling.canonical(), sort_keys=True, separators=(",", ":")).encode())
    _field(h, tenant_salt(tenant, shareable))
    _field(h, struct.pack(f"<{len(prompt_ids)}I", *prompt_ids))
    if tools:
        _field(h, b"tools/" + tools.encode())
    return Scope(Kind.RESPONSE, model_id, model_version, tenant, shareable).entry(h.hexdigest())


def scope_of(key: str) -> tuple[str, str, str]:
    """The ledger keys of the scope an entry key belongs to."""
    head, sep, _rest = key.rpartition(":e:")
    if not sep or not head.startswith(NAMESPACE + ":{"):
        raise ValueError(f"not a meshserve cache entry key: {key!r}")
    return f"{head}:ix", f"{head}:sz", f"{head}:used"


def kv_block_hashes(
    *,
    model_id: str,
    model_version: str,
    tenant: str,
    token_ids: Sequence[int],
    block_tokens: int,
    shareable: bool = False,
    limit: int | None = None,
) -> list[bytes]:
    """SHA-256 chain digests of the full ``block_tokens``-sized blocks of ``token_ids``, in order.

    These are the digests inside :func:`kv_block_keys` (``entry(digest.hex())``), so a block hash
    names one block of one prefix in one scope: routers and workers compare them to say which
    replica holds KV for a prompt's prefix without building Redis keys. ``limit`` stops after that
    many blocks.
    """
    if block_tokens <= 0:
        raise ValueError("block_tokens must be positive")
    salt = tenant_salt(tenant, shareable)
    head = struct.pack("<Q", 32)
    scope = b"".join(struct.pack("<Q", len(f)) + f for f in (model_id.encode(), model_version.encode(), salt))
    data = array("I", token_ids)  # one conversion for all blocks: the same bytes as "<I" per token
    if sys.byteorder == "big":
        data.byteswap()
    raw = data.tobytes()
    step = block_tokens * 4
    block_head = struct.pack("<Q", step)
    n = len(token_ids) // block_tokens
    if limit is not None:
        n = min(n, limit)
    parent = _ROOT
    out: list[bytes] = []
    for start in range(0, n * step, step):
        parent = hashlib.sha256(head + parent + scope + block_head + raw[start : start + step]).digest()
        out.append(parent)
    return out


def kv_block_keys(
    *,
    model_id: str,
    model_version: str,
    tenant: str,
    token_ids: Sequence[int],
    block_tokens: int,
    shareable: bool = False,
) -> list[str]:
    """Keys of the full ``block_tokens``-sized blocks of ``token_ids``, in chain order.

    Block i's hash covers block i-1's hash, so a key names the whole prefix up to its block; a
    trailing partial block has no key.
    """
    scope = Scope(Kind.KV, model_id, model_version, tenant, shareable)
    digests = kv_block_hashes(
        model_id=model_id,
        model_version=model_version,
        tenant=tenant,
        token_ids=token_ids,
        block_tokens=block_tokens,
        shareable=shareable,
    )
    prefix = f"{scope.prefix}:e:"  # the tag costs two SHA-256: once per chain, not per block
    return [prefix + d.hex() for d in digests]


def scan_pattern(
    kind: Kind | None = None,
    model_id: str | None = None,
    model_version: str | None = None,
    tenant: str | None = None,
    shareable: bool = False,
    suffix: str = "*",
) -> str:
    """SCAN MATCH pattern for keys of the scopes matching the given filters (None = any)."""
    k = kind.value if kind else "?"
    m = model_tag(model_id) if model_id else "*"
    v = version_tag(model_version) if model_version else "*"
    if tenant is None and not shareable:
        s = "*"
    else:
        s = scope_tag(tenant or "", shareable)
    return f"{NAMESPACE}:{{{k}|{m}|{v}|{s}}}:{suffix}"


def response_pattern(model_id: str | None = None) -> str:
    """SCAN pattern matching the response-cache entries (of one model, or all)."""
    return scan_pattern(Kind.RESPONSE, model_id, suffix="e:*")


_SCOPE = re.compile(r"^[0-9a-f]{16}$")


def stored_response_key(scope: str, response_id: str) -> str:
    """Key of the stored ``/v1/responses`` response ``response_id`` of the tenant whose
    :func:`scope_tag` is ``scope`` (module docstring); ValueError for anything but 16 hex digits.

    The tenant's scope is part of the key, so a tenant can only ever name its own responses."""
    if not _SCOPE.match(scope):
        raise ValueError(f"not a tenant scope digest: {scope!r}")
    return f"{NAMESPACE}:{{s|{scope}}}:resp:{response_id}"


# Rollout policies shared by the router replicas (services/store/rollouts.py): one hash per model.
ROLLOUT_CHANNEL = f"{NAMESPACE}:rollouts"
"""Pub/sub channel on which a changed rollout policy is announced (the message: the model id)."""


def rollout_key(model_id: str) -> str:
    """Hash of one model's shared rollout policy (services/store/rollouts.py): epoch, policy, by, reason."""
    return f"{NAMESPACE}:{{rollout|{model_tag(model_id)}}}:policy"


# Files and batches (services/store/files.py, batches.py). Everything of one tenant's files and
# batches shares one hash tag, ``{B|<scope digest>}`` (one slot: a batch's results, its counters and
# the tenant's quota counters change together in one script); the work stream every batch runner
# reads and the set of live batches are global, under ``{batchq}``.
BATCH_WORK_STREAM = f"{NAMESPACE}:{{batchq}}:work"
"""Stream of batch lines to run (consumer group ``runners``)."""
BATCH_ACTIVE = f"{NAMESPACE}:{{batchq}}:active"
"""Sorted set of live batches (``<tenant>\\t<batch id>``, by creation time) that runners sweep."""


def batch_tenant_prefix(tenant: str) -> str:
    """Prefix of every key of ``tenant``'s files and batches (the tenant never in clear)."""
    return f"{NAMESPACE}:{{B|{scope_tag(tenant, False)}}}"
