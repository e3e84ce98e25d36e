"""The router's cache of recently tokenized prompts: bounded LRU, callers never share a list."""

from __future__ import annotations

from services.router.servicer import _EncodeCache


def test_repeated_prompts_get_their_ids_and_callers_get_their_own_list() -> None:
    cache = _EncodeCache(2)
    assert cache.get("hello") is None
    cache.put("hello", [1, 2, 3])
    first = cache.get("hello")
    assert first == [1, 2, 3]
    assert first is not None
    first.append(99)
    assert cache.get("hello") == [1, 2, 3]


def test_the_least_recently_used_prompt_goes_first() -> None:
    cache = _EncodeCache(2)
    cache.put("a", [1])
    cache.put("b", [2])
    assert cache.get("a") == [1]  # a is now the most recent
    cache.put("c", [3])
    assert cache.get("b") is None
    assert cache.get("a") == [1] and cache.get("c") == [3]
