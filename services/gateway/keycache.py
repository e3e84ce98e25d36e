"""In-process cache of stored API-key records, so a known key costs no Redis round trip per request.

Entries live ``ttl_s`` seconds (``MESHSERVE_GATEWAY_KEY_CACHE_TTL_S``, default 1 s): that is the bound
on how long a revoked key keeps working on a gateway that had just seen it. Only keys that exist are
cached (an unknown key always asks Redis, so a key works the moment it is created and guessing
cannot fill the cache); the cache is keyed by the SHA-256 of the key, never the key. Expiry is
checked on every request against the cached record, so caching never extends a key's lifetime.
At most ``max_entries`` records are held; the oldest go first.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from services.gateway.keystore import KeyRecord


class KeyRecordCache:
    """Stored-key records kept in process for ``ttl_s`` (the bound on how late a revocation takes effect)."""

    def __init__(self, ttl_s: float, max_entries: int = 10_000, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._entries: dict[str, tuple[float, KeyRecord]] = {}

    def get(self, digest: str) -> KeyRecord | None:
        """The record cached for ``digest`` if it is younger than the TTL."""
        entry = self._entries.get(digest)
        if entry is None:
            return None
        if self._clock() >= entry[0]:
            del self._entries[digest]
            return None
        return entry[1]

    def put(self, digest: str, record: KeyRecord) -> None:
        if self.ttl_s <= 0:
            return
        if digest not in self._entries and len(self._entries) >= self.max_entries:
            del self._entries[next(iter(self._entries))]
        self._entries[digest] = (self._clock() + self.ttl_s, record)

    def __len__(self) -> int:
        return len(self._entries)
