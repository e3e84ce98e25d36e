"""Prepacked linear layers (packed.py): same results as ``F.linear`` for every row count."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.gpu_worker.packed import Linear, can_prepack


def test_prepacking_is_for_cpu_float32_only() -> None:
    assert can_prepack(torch.device("cpu"), torch.float32) == torch.backends.mkldnn.is_available()
    assert not can_prepack(torch.device("cpu"), torch.bfloat16)
    assert not can_prepack(torch.device("cuda"), torch.float32)


def test_packed_linear_equals_f_linear_for_one_to_many_rows() -> None:
    torch.manual_seed(0)
    weight = torch.randn(96, 64)
    for single_row_packed in (False, True):
        layer = Linear(
            weight, prepack=can_prepack(torch.device("cpu"), torch.float32), single_row_packed=single_row_packed
        )
        for rows in (1, 2, 5, 9, 33):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(layer(x), F.linear(x, weight), atol=1e-4, rtol=1e-5)


def test_unpacked_layer_keeps_only_the_plain_weight() -> None:
    layer = Linear(torch.ones(4, 3), prepack=False)
    assert layer.packed is None
    assert layer(torch.ones(2, 3)).tolist() == [[3.0] * 4] * 2
