"""The router's cache of recently tokenized prompts: bounded LRU, callers never share a list."""

from __future__ import annotations

from services.router.frontend.encoding import EncodeCache


def test_repeated_prompts_get_their_ids_and_callers_get_their_own_list() -> None:
    cache = EncodeCache(2)
    assert cache.get("hello") is None
    cache.put("hello", [1, 2, 3])
    first = cache.get("hello")
    assert first == [1, 2, 3]
    assert first is not None
    first.append(99)
    assert cache.get("hello") == [1, 2, 3]


def test_the_least_recently_used_prompt_goes_first() -> None:
    cache = EncodeCache(2)
    cache.put("a", [1])
    cache.put("b", [2])
    assert cache.get("a") == [1]  # a is now the most recent
    cache.put("c", [3])
    assert cache.get("b") is None
    assert cache.get("a") == [1] and cache.get("c") == [3]


def test_the_token_ids_held_are_bounded_too() -> None:
    cache = EncodeCache(2048, max_tokens=10_000)
    for i in range(500):  # distinct long prompts: entries alone would allow all of them
        cache.put(f"prompt {i}", list(range(i, i + 1000)))
        assert cache.tokens <= 10_000
    assert cache.tokens == 10_000
    assert cache.get("prompt 499") == list(range(499, 1499))  # the most recent are kept
    assert cache.get("prompt 489") is None
    cache.put("prompt 499", [7])  # replacing an entry gives its ids back
    assert cache.tokens == 9_001 and cache.get("prompt 499") == [7]
    cache.put("huge", list(range(20_000)))  # larger than the whole budget: not kept, nothing evicted
    assert cache.get("huge") is None and cache.tokens == 9_001
