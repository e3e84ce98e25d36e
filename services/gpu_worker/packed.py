"""Linear layers with a oneDNN-prepacked weight for multi-row steps on CPU.

Why: on CPU, ``F.linear`` (MKL sgemm) over a few rows costs about one pass over the weights *per
row*: a speculative verify pass of 5 tokens, or a batch step of a few sequences, cost 2-2.5 single
token steps for SmolLM2-135M (docs/benchmarks/cloud_spec.md), because small-M sgemm repacks and
re-reads the weight on every call. oneDNN with the weight reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, the kernel ``torch.compile``'s CPU freezing pass
uses) runs those steps close to the memory-bound cost of reading the weight once. For a single row
(a decode step of one sequence) MKL's gemv stays as fast or faster, so :class:`Linear` keeps the
plain weight for that case: the price is a second copy of the weights in memory (fp32 on CPU only).
The LM head, whose packed form is faster for every row count, has no second copy beyond the
embedding it is tied to.

Results match ``F.linear`` to float32 rounding (a different summation order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacking is available and used for this device and dtype (CPU float32)."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def _pack(weight: Tensor, rows_hint: int) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)


def _packed_linear(x: Tensor, packed: Tensor) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


class Linear:
    """``y = x @ weight.T``; rows > 1 (or every row, with ``single_row_packed``) use the packed weight."""

    ROWS_HINT = 8
    """oneDNN picks its blocking for about this many rows: verify passes and small batches."""

    def __init__(self, weight: Tensor, *, prepack: bool, single_row_packed: bool = False) -> None:
        self.weight = weight
        self.packed = _pack(weight, self.ROWS_HINT) if prepack else None
        self._min_rows = 1 if single_row_packed else 2

    def __call__(self, x: Tensor) -> Tensor:
        if self.packed is not None and x.shape[0] >= self._min_rows:
            return _packed_linear(x, self.packed)
        return F.linear(x, self.weight)
