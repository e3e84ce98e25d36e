"""Embeddings of the cloud engine's model: pooling against transformers, batching, truncation, refusals."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.common.errors import InvalidArgument
from services.gpu_worker import embed
from services.gpu_worker.config import GpuWorkerSettings
from services.gpu_worker.model import LlamaModel

pytestmark = pytest.mark.integration
INPUTS = [[504, 3092, 282, 253, 1789], [19556], list(range(100, 124))]


@pytest.fixture(scope="module")
def model() -> Iterator[LlamaModel]:
    torch.set_num_threads(1)
    yield LlamaModel.load(GpuWorkerSettings().check_model(), device=torch.device("cpu"), dtype=torch.float32)


def test_pooling_matches_transformers_mean_of_the_normed_last_hidden_state(model: LlamaModel) -> None:
    hf = AutoModelForCausalLM.from_pretrained(GpuWorkerSettings().check_model(), dtype=torch.float32)
    pooled = model.pooled(INPUTS)  # one padded batch: padding must change nothing
    for row, ids in enumerate(INPUTS):
        with torch.inference_mode():
            hidden = hf.model(torch.tensor([ids])).last_hidden_state[0]  # after the final norm
        reference = hidden.mean(dim=0)
        torch.testing.assert_close(pooled[row], reference, atol=2e-4, rtol=1e-4)


def test_batched_equals_one_by_one_and_vectors_are_unit(model: LlamaModel) -> None:
    batched = torch.tensor(embed.embed(model, INPUTS))
    alone = torch.tensor([embed.embed(model, [ids])[0] for ids in INPUTS])
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batched.norm(dim=-1), torch.ones(len(INPUTS)))
    # Small padded-token budgets cut the request into several forwards: the same vectors.
    split = torch.tensor(embed.embed(model, INPUTS, batch_tokens=24))
    torch.testing.assert_close(split, batched, atol=1e-5, rtol=1e-5)


def test_dimensions_truncate_then_renormalise(model: LlamaModel) -> None:
    full = torch.tensor(embed.embed(model, INPUTS[:1]))
    short = torch.tensor(embed.embed(model, INPUTS[:1], dimensions=64))
    assert short.shape == (1, 64)
    torch.testing.assert_close(short[0], torch.nn.functional.normalize(full[0, :64], dim=0), atol=1e-5, rtol=1e-5)


def test_bad_inputs_are_refused_naming_the_input() -> None:
    limits = dict(vocab=100, context=8, hidden=16)
    with pytest.raises(InvalidArgument, match=r"inputs\[1\] has no tokens"):
        embed.check_inputs([[1], []], dimensions=0, **limits)
    with pytest.raises(InvalidArgument, match=r"inputs\[0\] holds token id"):
        embed.check_inputs([[100]], dimensions=0, **limits)
    with pytest.raises(InvalidArgument, match=r"above the model's context"):
        embed.check_inputs([[1] * 9], dimensions=0, **limits)
    with pytest.raises(InvalidArgument, match=r"dimensions is 9999"):
        embed.check_inputs([[1]], dimensions=9999, **limits)
