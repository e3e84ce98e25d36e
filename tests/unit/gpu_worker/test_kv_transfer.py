"""The cloud engine's ImportKV/ExportKV refuse engines without a Redis prefix cache (no model needed)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from services.common.errors import FailedPrecondition
from services.gpu_worker.kv_transfer import export_prefix, import_prefix
from services.worker.kv_transfer import KVPrefix

PREFIX = KVPrefix(tuple(range(40)), "acme")


@pytest.mark.parametrize(
    ("engine", "hint"),
    [
        (SimpleNamespace(prefix_cache=False, redis=object()), "MESHSERVE_GPU_WORKER_PREFIX_CACHE=true"),
        (SimpleNamespace(prefix_cache=True, redis=None), "no Redis for its KV prefix cache"),
    ],
)
def test_without_a_redis_prefix_cache_both_are_failed_precondition(engine: Any, hint: str) -> None:
    for op in (import_prefix, export_prefix):
        with pytest.raises(FailedPrecondition, match=hint):
            op(engine, PREFIX)
