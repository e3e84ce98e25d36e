"""Embeddings from the cloud engine's model: pooled, normalised, optionally truncated, in padded batches.

Why the cloud tier: the edge engine's INT4 ONNX graph ends in the LM head over the last positions
only (services/edge_worker/graph.py slices the hidden states before it), so it has no pooled hidden
states to give without exporting a second graph; the torch model here computes them in one forward.

Pooling (the contract of ``meshserve.v1.EmbedRequest``): the final hidden states after the final
RMSNorm, the mean over the input's tokens, L2-normalised; ``dimensions`` keeps the first components
and normalises again. Inputs are sorted by length and cut into batches of at most
``batch_tokens`` padded tokens, so a request of many short inputs is a few forwards and a long
input does not pad thousands of short ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from services.common.errors import InvalidArgument

BATCH_TOKENS = 8192
"""Padded tokens (rows x longest input) per forward: bounds the attention mask and activations."""


class Pooler(Protocol):
    def pooled(self, inputs: Sequence[Sequence[int]]) -> Tensor: ...


def check_inputs(inputs: Sequence[Sequence[int]], *, vocab: int, context: int, hidden: int, dimensions: int) -> None:
    """Raise :class:`InvalidArgument` naming the first bad input (or ``dimensions``)."""
    if not inputs:
        raise InvalidArgument("inputs is empty; send at least one input to embed")
    if dimensions > hidden:
        raise InvalidArgument(f"dimensions is {dimensions}, above the model's {hidden}; ask for {hidden} or fewer")
    for i, ids in enumerate(inputs):
        if not ids:
            raise InvalidArgument(f"inputs[{i}] has no tokens; send at least one token per input")
        if len(ids) > context:
            raise InvalidArgument(
                f"inputs[{i}] is {len(ids)} tokens, above the model's context of {context}; shorten it"
            )
        top = max(ids)
        if top >= vocab:
            raise InvalidArgument(f"inputs[{i}] holds token id {top}, outside the vocabulary of {vocab}")


def embed(
    model: Pooler, inputs: Sequence[Sequence[int]], *, dimensions: int = 0, batch_tokens: int = BATCH_TOKENS
) -> list[list[float]]:
    """One unit vector per input, in input order (see the module docstring)."""
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
    out: list[list[float]] = [[] for _ in inputs]
    start = 0
    while start < len(order):
        end = start + 1
        # Sorted by length: the last row of a batch is its longest, so rows x its length is the padding.
        while end < len(order) and (end - start + 1) * len(inputs[order[end]]) <= batch_tokens:
            end += 1
        batch = order[start:end]
        vectors = model.pooled([inputs[i] for i in batch])
        if dimensions:
            vectors = vectors[:, :dimensions]
        vectors = torch.nn.functional.normalize(vectors, dim=-1)
        for i, row in zip(batch, vectors.cpu().tolist(), strict=True):
            out[i] = row
        start = end
    return out
