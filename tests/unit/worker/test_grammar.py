"""Constraint compilation (llguidance) on the served model's tokenizer: masks, bounds, the LRU, replay."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from tokenizers import Tokenizer

from services.common.constraints import check_constraint
from services.common.errors import InvalidArgument
from services.common.model_paths import model_paths
from services.worker import grammar
from services.worker.grammar import GrammarCompiler, unpack

EOS = 2
VOCAB = 49152


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(model_paths().hf_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> Iterator[GrammarCompiler]:
    c = GrammarCompiler(tokenizer, VOCAB, [EOS])
    yield c
    c.close()


def test_the_mask_allows_exactly_the_tokens_that_keep_the_regex_possible(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    state = compiler.open(check_constraint("regex", "[0-9]{3}-(yes|no)"))
    allowed = np.flatnonzero(state.allowed())
    assert allowed.size > 0 and EOS not in allowed  # nothing yet: not complete
    for token in allowed:
        assert re.fullmatch(r"[0-9]{1,3}", tokenizer.decode([int(token)])), token
    for token in tokenizer.encode("123-ye", add_special_tokens=False).ids:
        state.advance(token)
    assert not state.accepting and EOS not in np.flatnonzero(state.allowed())
    state.advance(tokenizer.token_to_id("s"))
    assert state.accepting
    assert list(np.flatnonzero(state.allowed())) == [EOS]  # complete: only EOS may follow


def test_apply_masks_a_logits_row_in_place(compiler: GrammarCompiler) -> None:
    state = compiler.open(check_constraint("regex", "(yes|no)"))
    logits = np.random.default_rng(0).standard_normal(VOCAB).astype(np.float32)
    before = logits.copy()
    state.apply(logits)
    allowed = state.allowed()
    assert np.array_equal(logits[allowed], before[allowed])
    assert np.all(logits[~allowed] == -np.inf)
    assert np.array_equal(unpack(state.bitmask(), VOCAB), allowed)


def test_replayed_tokens_advance_the_grammar(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    constraint = check_constraint("json_object")
    text = tokenizer.encode('{"a": [1, 2', add_special_tokens=False).ids
    walked = compiler.open(constraint)
    for token in text:
        walked.advance(token)
    replayed = compiler.open(constraint, replay=text)
    assert np.array_equal(replayed.bitmask(), walked.bitmask())
    assert not np.array_equal(compiler.open(constraint).bitmask(), walked.bitmask())


@pytest.mark.parametrize(
    ("kind", "text"),
    [
        ("regex", "(("),
        ("grammar", "start: undefined_rule"),
        ("json_schema", '{"type": "no-such-type"}'),
    ],
)
def test_a_constraint_that_does_not_compile_is_invalid_argument(
    compiler: GrammarCompiler, kind: str, text: str
) -> None:
    with pytest.raises(InvalidArgument, match=rf"^response_format \(sampling\.structured\): the {kind} is not valid"):
        compiler.open(check_constraint(kind, text))


def test_compilation_past_its_time_limit_is_invalid_argument_naming_the_limit(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A compilation that cannot finish before the limit (a real one of a few ms could, on a busy host,
    # finish while the caller waits to be scheduled): it runs until the test lets it go.
    release = threading.Event()
    real = grammar._compile

    def stuck(*args: object) -> object:
        release.wait(30)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(grammar, "_compile", stuck)
    slow = GrammarCompiler(tokenizer, VOCAB, [EOS], timeout_s=0.05)
    try:
        slow.warm()  # the tokenizer is built outside the limit
        with pytest.raises(InvalidArgument, match=r"did not compile within the limit of 0.05 s"):
            slow.open(check_constraint("json_schema", '{"type": "object", "properties": {"a": {"type": "string"}}}'))
    finally:
        release.set()
        slow.close()


def test_compiled_grammars_are_cached_by_digest_in_a_bounded_lru(tokenizer: Tokenizer) -> None:
    small = GrammarCompiler(tokenizer, VOCAB, [EOS], cache_entries=2)
    try:
        a, b, c = (check_constraint("regex", r) for r in ("a+", "b+", "c+"))
        first = small.compiled(a)
        assert small.compiled(a) is first  # a hit
        small.compiled(b)
        small.compiled(c)  # evicts a, the least recently used
        assert small.compiled(a) is not first
        # sequences get their own state: advancing one leaves the cached start state alone
        state = small.open(b)
        state.advance(tokenizer.token_to_id("b"))
        assert not np.array_equal(state.bitmask(), small.open(b).bitmask())
    finally:
        small.close()
