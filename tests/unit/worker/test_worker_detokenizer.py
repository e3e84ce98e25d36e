from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.worker.detokenizer import Detokenizers, IncrementalDetokenizer
from services.worker.token_texts import TokenTexts
from tests.unit.worker.fakes import TOKENIZER, VOCAB

E_ACUTE = (VOCAB.index(b"\xc3"), VOCAB.index(b"\xa9"))


def test_deltas_concatenate_to_full_decode() -> None:
    ids = TOKENIZER.encode("hello world, abc") + list(E_ACUTE) + TOKENIZER.encode(" zz")
    detok = IncrementalDetokenizer(TOKENIZER, TOKENIZER.encode("ctx"))
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) + detok.flush() == TOKENIZER.decode(ids)


def test_split_utf8_character_is_held_until_complete() -> None:
    detok = IncrementalDetokenizer(TOKENIZER)
    assert detok.add(E_ACUTE[0]) == ""
    assert detok.add(E_ACUTE[1]) == "é"


def test_incomplete_character_is_flushed_as_replacement() -> None:
    detok = IncrementalDetokenizer(TOKENIZER)
    detok.add(E_ACUTE[0])
    assert detok.flush() == "\ufffd"


def test_long_generation_keeps_window_small() -> None:
    detok = IncrementalDetokenizer(TOKENIZER)
    ids = TOKENIZER.encode("abcdefghij" * 20)
    assert "".join(detok.add(i) for i in ids) == "abcdefghij" * 20
    assert len(detok._ids) <= 8


def _real_tokenizer():  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer

    from services.common.model_paths import model_paths

    return Tokenizer.from_file(str(model_paths().hf_dir / "tokenizer.json"))


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(
        st.one_of(st.integers(min_value=0, max_value=49151), st.integers(min_value=0, max_value=20)), max_size=40
    ),
    context=st.lists(st.integers(min_value=17, max_value=49151), max_size=8),
)
def test_the_byte_level_detokenizer_gives_what_the_real_tokenizer_decodes(ids: list[int], context: list[int]) -> None:
    # Any ids of SmolLM2's vocabulary: specials (skipped), word pieces, byte tokens of partial UTF-8
    # characters (the low ids of its byte alphabet), after any prompt.
    tokenizer = _real_tokenizer_cached()
    factory = Detokenizers(tokenizer, TokenTexts(tokenizer))
    assert factory.fast
    fast = factory.new(context)
    slow = IncrementalDetokenizer(tokenizer, context)
    fast_text = "".join(fast.add(i) for i in ids) + fast.flush()
    assert fast_text == tokenizer.decode(ids, skip_special_tokens=True)
    if not context or "\ufffd" not in tokenizer.decode(context[-6:]):  # (a prompt ending in a partial character
        slow_text = "".join(slow.add(i) for i in ids) + slow.flush()  # is counted there by the other)
        assert fast_text == slow_text


def test_the_byte_level_detokenizer_holds_only_a_split_character() -> None:
    tokenizer = _real_tokenizer_cached()
    text = "é ü 日本"
    ids = tokenizer.encode(text).ids
    fast = Detokenizers(tokenizer, TokenTexts(tokenizer)).new()
    deltas = [fast.add(i) for i in ids]
    assert "".join(deltas) == text and "\ufffd" not in "".join(deltas)
    partial = [i for i, d in zip(ids, deltas, strict=True) if d == ""]
    assert all(tokenizer.decode([i]) == "\ufffd" for i in partial)  # held: the first byte(s) of a character


def test_a_fake_tokenizer_gets_the_general_detokenizer() -> None:
    assert not Detokenizers(TOKENIZER, TokenTexts(TOKENIZER)).fast
    assert isinstance(Detokenizers(TOKENIZER, TokenTexts(TOKENIZER)).new(), IncrementalDetokenizer)


_CACHE: list[object] = []


def _real_tokenizer_cached():  # type: ignore[no-untyped-def]
    if not _CACHE:
        _CACHE.append(_real_tokenizer())
    return _CACHE[0]
