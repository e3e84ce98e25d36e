"""Bias correction helpers: MatMulNBits dequantization and the builder-name -> HF weight mapping."""

from __future__ import annotations

import numpy as np
import pytest

from services.models.biascorrect import _source, dequantize

RNG = np.random.default_rng(0)


def pack4(q: np.ndarray) -> np.ndarray:
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def test_dequantize_4_bit_with_packed_zero_points() -> None:
    n, k, block = 3, 96, 32  # 3 blocks: an odd count, so the last zero-point byte is half padding
    q = RNG.integers(0, 16, size=(n, k // block, block), dtype=np.uint8)
    zp = RNG.integers(0, 16, size=(n, k // block), dtype=np.uint8)
    scales = RNG.random((n, k // block), dtype=np.float32)
    zp_packed = pack4(np.concatenate([zp, np.zeros((n, 1), np.uint8)], axis=1))
    attrs = {"bits": 4, "N": n, "K": k, "block_size": block}
    got = dequantize(attrs, pack4(q), scales, zp_packed)
    want = ((q.astype(np.float64) - zp[..., None]) * scales[..., None]).reshape(n, k)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_dequantize_8_bit_symmetric_and_float_zero_points() -> None:
    n, k, block = 2, 64, 32
    q = RNG.integers(0, 256, size=(n, k // block, block), dtype=np.uint8)
    scales = RNG.random((n, k // block), dtype=np.float32)
    attrs = {"bits": 8, "N": n, "K": k, "block_size": block}
    want = ((q.astype(np.float64) - 128) * scales[..., None]).reshape(n, k)
    np.testing.assert_allclose(dequantize(attrs, q, scales, None), want, rtol=1e-6)
    zf = np.full((n, k // block), 100.5, dtype=np.float32)
    want = ((q.astype(np.float64) - 100.5) * scales[..., None]).reshape(n, k)
    np.testing.assert_allclose(dequantize(attrs, q, scales, zf), want, rtol=1e-6)
    with pytest.raises(ValueError, match="3 bits"):
        dequantize({**attrs, "bits": 3}, q, scales, None)


class FakeTensor:
    def __init__(self, value: np.ndarray) -> None:
        self.value = value

    def numpy(self) -> np.ndarray:
        return self.value


def test_builder_node_names_map_to_hf_weights_and_means() -> None:
    w = {name: FakeTensor(np.full((2, 4), float(i))) for i, name in enumerate(["q", "k", "v", "o", "down", "emb"])}
    state = {
        "model.layers.3.self_attn.q_proj.weight": w["q"],
        "model.layers.3.self_attn.k_proj.weight": w["k"],
        "model.layers.3.self_attn.v_proj.weight": w["v"],
        "model.layers.3.self_attn.o_proj.weight": w["o"],
        "model.layers.3.mlp.down_proj.weight": w["down"],
        "model.embed_tokens.weight": w["emb"],
    }
    mu = np.arange(4.0)
    means = {
        "model.layers.3.self_attn.q_proj": mu,
        "model.layers.3.self_attn.o_proj": mu + 1,
        "model.layers.3.mlp.down_proj": mu + 2,
        "lm_head": mu + 3,
    }
    qkv = _source("/model/layers.3/attn/qkv_proj/MatMul_Q4", state, means)
    assert qkv is not None and qkv[0].shape == (6, 4) and list(qkv[0][:, 0]) == [0, 0, 1, 1, 2, 2]
    assert qkv[1] is mu
    down = _source("/model/layers.3/mlp/down_proj/MatMul_Q8", state, means)
    assert down is not None and down[0][0, 0] == 4.0 and down[1][0] == 2.0
    head = _source("/lm_head/MatMul_Q8", state, means)  # tied: the embedding table
    assert head is not None and head[0][0, 0] == 5.0
    assert _source("/model/layers.3/mlp/gate_proj/MatMul_Q4", state, means) is None  # no such weight
    assert _source("/model/something/else/MatMul", state, means) is None
