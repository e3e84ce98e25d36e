"""Prepacked linear layers (packed.py): same results as ``F.linear`` for every row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.gpu_worker.packed import Linear, Packer, can_prepack


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


def test_a_background_packed_layer_waits_for_its_weight_and_equals_the_packed_one() -> None:
    torch.manual_seed(1)
    weight = torch.randn(96, 64)
    pack = can_prepack(torch.device("cpu"), torch.float32)
    packer = Packer()
    deferred = [Linear(weight, prepack=pack, packer=packer, single_row_packed=s) for s in (False, True)]
    now = [Linear(weight, prepack=pack, single_row_packed=s) for s in (False, True)]
    assert all(layer.packed is None for layer in deferred)
    packer.start()
    x = torch.randn(5, 64)
    for a, b in zip(deferred, now, strict=True):
        assert torch.equal(a(x), b(x))  # waited for the packer, then the same kernel
        assert torch.equal(a(x[:1]), b(x[:1]))
    assert packer.done and all((layer.packed is not None) == pack for layer in deferred)
    with pytest.raises(RuntimeError):
        packer.add(Linear(weight, prepack=pack))
