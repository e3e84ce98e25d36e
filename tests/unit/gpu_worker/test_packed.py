"""Prepacked linear layers (packed.py): same results as ``F.linear`` for every row count."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from services.gpu_worker.packed import Linear, Packer, can_prepack

_REPO = Path(__file__).resolve().parents[3]

_REUSE = textwrap.dedent(
    """
    import sys, torch
    from services.gpu_worker.packed import Linear, limit_primitive_cache
    limit_primitive_cache(int(sys.argv[1]))  # after torch's import, before its first oneDNN call
    layer = Linear(torch.randn(64, 32), prepack=True)
    for rows in (3, 4, 5, 3):
        layer(torch.randn(rows, 32))
    """
)


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


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN is not in this torch build")
@pytest.mark.parametrize(("entries", "reused"), [(2, False), (128, True)])
def test_the_primitive_cache_limit_takes_effect_when_set_before_the_first_call(entries: int, reused: bool) -> None:
    """Rows 3, 4, 5, then 3 again: with room for 2 kernels the last one is built again (LRU); with 128 it
    is found. oneDNN's verbose mode names each creation a cache hit or miss."""
    env = {**os.environ, "ONEDNN_VERBOSE": "profile_create"}
    out = subprocess.run(
        [sys.executable, "-c", _REUSE, str(entries)],
        cwd=_REPO,  # `-c` imports services from the working directory
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    matmuls = [line for line in out.splitlines() if ",inner_product," in line and "create:" in line]
    assert [",create:cache_hit," in line for line in matmuls] == [False, False, False, reused]
