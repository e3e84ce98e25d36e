"""The cloud tier's logprobs on hand-made logits: the device sampler's (one copy with the tokens, only
the rows that ask) equal a reference ``log_softmax`` of the penalised row, top-k
most likely first; the static decode step gives the eager step's."""

from __future__ import annotations

import pytest
import torch

from services.common.sampling import SamplingParams
from services.gpu_worker.device_sampler import PAD_ROW, RowSampling, sample_rows, sample_rows_with_logprobs
from services.gpu_worker.graphs import StaticDecoder
from services.gpu_worker.plan import Segment
from services.gpu_worker.sampler import Sampler
from tests.unit.gpu_worker.test_static_decoder import BLOCKS, BT, PAD, prefill, tiny


def test_only_the_rows_that_ask_get_logprobs_equal_to_log_softmax() -> None:
    torch.manual_seed(3)
    x = torch.randn(4, 500) * 3
    rows = [PAD_ROW, RowSampling(False, 0.8, 0, 1.0, 11), PAD_ROW, PAD_ROW]
    tokens, lps = sample_rows_with_logprobs(x, rows, [0, 0, 0, 0], None, [None, 5, 0, None])
    assert tokens == sample_rows(x, rows, [0, 0, 0, 0])  # asking changes no token
    assert lps[0] is None and lps[3] is None
    want = torch.log_softmax(x.double(), dim=-1)
    for i, top in ((1, 5), (2, 0)):
        got = lps[i]
        assert got is not None and got.token_id == tokens[i]
        assert got.logprob == pytest.approx(want[i, tokens[i]].item(), abs=1e-5)
        values, ids = want[i].topk(top)
        assert list(got.top_ids) == ids.tolist()
        assert got.top_logprobs == pytest.approx(values.tolist(), abs=1e-5)
    assert sample_rows_with_logprobs(x, rows, [0, 0, 0, 0])[1] == [None] * 4


@pytest.mark.parametrize("greedy", [True, False])
def test_a_sequences_logprobs_are_of_its_penalised_row(greedy: bool) -> None:
    x = torch.tensor([[1.0, 5.0, 4.9, 4.0, 0.0, 0.5]])
    sampling = SamplingParams(
        max_tokens=8, temperature=0 if greedy else 1.0, seed=5, repetition_penalty=1.5, logprobs=True, top_logprobs=3
    )
    state = Sampler(sampling, [1])
    (token,), (got,) = sample_rows_with_logprobs(x, [state.row], [0], [state.penalties], [state.top])
    penalised = x.clone()
    penalised[0, 1] /= 1.5
    want = torch.log_softmax(penalised.double(), dim=-1)[0]
    if greedy:
        assert token == int(penalised.argmax())
    assert got is not None and got.logprob == pytest.approx(want[token].item(), abs=1e-6)
    assert list(got.top_ids) == [2, 3, 1]
    assert got.top_logprobs == pytest.approx(want[[2, 3, 1]].tolist(), abs=1e-5)


def test_the_static_step_gives_the_eager_logprobs() -> None:
    model = tiny()
    tables = [[0, 1, 2], [3, 4]]
    lengths = [9, 5]
    eager_cache = model.new_cache(BLOCKS, BT, torch.float32)
    static_cache = model.new_cache(BLOCKS, BT, torch.float32)
    for cache in (eager_cache, static_cache):
        prefill(model, cache, tables, lengths)
    decode = [Segment([7 + i], n, t) for i, (t, n) in enumerate(zip(tables, lengths, strict=True))]
    logits = torch.cat(model.forward(decode, eager_cache))
    static = StaticDecoder(model, static_cache, max_batch=4, pad_block=PAD, max_context=PAD * BT, capture=True)
    tokens, lps = static.step_with_logprobs(decode, [PAD_ROW] * 2, [0, 0], (), [None, 4])
    assert tokens == logits.argmax(-1).tolist() and lps[0] is None
    want = torch.log_softmax(logits[1].double(), dim=-1)
    assert lps[1] is not None and lps[1].logprob == pytest.approx(want[tokens[1]].item(), abs=1e-4)
    assert list(lps[1].top_ids) == want.topk(4).indices.tolist()
