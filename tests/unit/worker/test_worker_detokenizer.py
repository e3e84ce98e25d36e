from __future__ import annotations

from services.worker.detokenizer import IncrementalDetokenizer
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
