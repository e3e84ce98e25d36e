"""Redis key schema of meshserve. No other module builds Redis keys by hand.

Every key lives under ``meshserve:v1:`` (bump the version when a key or value layout changes
incompatibly; old keys then simply expire). Response-cache keys::

    meshserve:v1:resp:<model_id>:<sha256 hex>

where the hash covers, each length-prefixed so no two field lists collide: the model id and version,
the tokenizer fingerprint, the canonical sampling parameters (JSON, sorted keys), the tenant salt
(or the "shared" marker for CACHE_POLICY_SHAREABLE_PREFIX) and the prompt token ids (little-endian
uint32). The model id stays readable in the key so an admin can invalidate one model with a SCAN.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

NAMESPACE = "meshserve:v1"
RESPONSE_PREFIX = f"{NAMESPACE}:resp"


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling parameters after defaults were applied (``max_tokens`` resolved, top_p 0 -> 1)."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def deterministic(self) -> bool:
        """Same prompt, same output: greedy decoding, or sampling with a fixed seed."""
        return self.greedy or self.seed is not None

    def canonical(self) -> dict[str, object]:
        """A normal form: equal for parameter sets that must produce the same tokens.

        Floats are rounded to 6 digits (proto float32 values like 0.7 arrive as 0.699999988); with
        greedy decoding top_p/top_k/seed cannot change the output, so they are dropped; stop strings
        are a set.
        """
        out: dict[str, object] = {
            "max_tokens": int(self.max_tokens),
            "stop": sorted(set(self.stop)),
        }
        if self.greedy:
            out["temperature"] = 0
            return out
        top_p = 1.0 if self.top_p <= 0 or self.top_p >= 1 else self.top_p
        out.update(
            temperature=_round(self.temperature),
            top_p=_round(top_p),
            top_k=int(self.top_k),
            seed=self.seed,
        )
        return out


def _round(x: float) -> float:
    if not math.isfinite(x):
        raise ValueError(f"sampling parameter must be finite, got {x!r}")
    return round(float(x), 6)


def _field(h: hashlib._Hash, data: bytes) -> None:
    h.update(struct.pack("<Q", len(data)))
    h.update(data)


def tenant_salt(tenant: str, shareable: bool) -> bytes:
    """What separates tenants in a key: the tenant id, or a fixed marker for shareable prompts."""
    return b"shared" if shareable else b"tenant:" + tenant.encode()


def response_key(
    *,
    model_id: str,
    model_version: str,
    tokenizer_id: str,
    sampling: SamplingSpec,
    prompt_ids: Sequence[int],
    tenant: str,
    shareable: bool = False,
) -> str:
    """Redis key of the cached response to exactly this request (see the module docstring)."""
    h = hashlib.sha256()
    _field(h, model_id.encode())
    _field(h, model_version.encode())
    _field(h, tokenizer_id.encode())
    _field(h, json.dumps(sampling.canonical(), sort_keys=True, separators=(",", ":")).encode())
    _field(h, tenant_salt(tenant, shareable))
    _field(h, struct.pack(f"<{len(prompt_ids)}I", *prompt_ids))
    return f"{RESPONSE_PREFIX}:{model_id}:{h.hexdigest()}"


def response_pattern(model_id: str | None = None) -> str:
    """SCAN pattern matching the response-cache keys (of one model, or all)."""
    return f"{RESPONSE_PREFIX}:{model_id}:*" if model_id else f"{RESPONSE_PREFIX}:*"
