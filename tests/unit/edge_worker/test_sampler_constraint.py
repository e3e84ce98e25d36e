"""The edge sampler under a structured-output constraint: only allowed tokens, greedy and sampled."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer

from services.common.constraints import check_constraint
from services.common.model_paths import model_paths
from services.common.sampling import SamplingParams
from services.edge_worker.sampler import pick, rng_for
from services.worker.grammar import GrammarCompiler, TokenConstraint

VOCAB = 49152


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(Tokenizer.from_file(str(model_paths().hf_dir / "tokenizer.json")), VOCAB, [2])


def state(compiler: GrammarCompiler) -> TokenConstraint:
    return compiler.open(check_constraint("regex", "(yes|no|maybe)"))


def test_greedy_picks_the_best_allowed_token(compiler: GrammarCompiler) -> None:
    logits = np.random.default_rng(1).standard_normal(VOCAB).astype(np.float32)
    constraint = state(compiler)
    allowed = constraint.allowed()
    best = int(np.flatnonzero(allowed)[np.argmax(logits[allowed])])
    sampling = SamplingParams(max_tokens=4)
    assert pick(logits.copy(), sampling, None, None, constraint) == best
    assert pick(logits.copy(), sampling, None) != best  # unconstrained: the global argmax


def test_sampling_draws_only_allowed_tokens(compiler: GrammarCompiler) -> None:
    sampling = SamplingParams(max_tokens=4, temperature=1.5, seed=3)
    rng = rng_for(sampling)
    constraint = state(compiler)
    allowed = constraint.allowed()
    logits = np.random.default_rng(2).standard_normal(VOCAB).astype(np.float32)
    for _ in range(50):
        assert allowed[pick(logits.copy(), sampling, rng, None, constraint)]


def test_a_read_only_row_is_copied_not_written(compiler: GrammarCompiler) -> None:
    logits = np.zeros(VOCAB, dtype=np.float32)
    logits.flags.writeable = False
    token = pick(logits, SamplingParams(max_tokens=4), None, None, state(compiler))
    assert state(compiler).allowed()[token]
    assert not np.isinf(logits).any()
