"""Fixtures the router unit tests share: the real tokenizer and a response cache with no Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from services.common.model_paths import model_paths
from services.common.tokenizer import Tokenizer
from services.store.response_cache import ResponseCache


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(model_paths().hf_dir)


@pytest.fixture
async def cache() -> AsyncIterator[ResponseCache]:
    cache = ResponseCache.from_url("")
    yield cache
    await cache.close()
