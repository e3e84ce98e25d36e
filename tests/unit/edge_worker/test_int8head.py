"""The LM head rewrite onto the int8 GEMM, on a small synthetic MatMulNBits head (fast, no model files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from services.edge_worker.int8head import int8_lm_head, quantize_columns
from services.models.biascorrect import dequantize

K, N, BLOCK = 64, 96, 32


def head_model(bits: int = 8, seed: int = 0) -> tuple[onnx.ModelProto, np.ndarray]:
    """hidden [batch, seq, K] -> 8-bit (or 4-bit) MatMulNBits with a bias -> logits; and its float weight."""
    rng = np.random.default_rng(seed)
    blocks = K // BLOCK
    q = rng.integers(0, 2**bits, (N, blocks, BLOCK)).astype(np.uint8)
    zeros = rng.integers(0, 2**bits, (N, blocks)).astype(np.uint8)
    if bits == 4:
        q = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
        zeros = (zeros[:, 0::2] | (zeros[:, 1::2] << 4)).astype(np.uint8)
    scales = (rng.random((N, blocks)) * 0.02 + 0.001).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    attrs: dict[str, Any] = {"K": K, "N": N, "bits": bits, "block_size": BLOCK}
    node = helper.make_node(
        "MatMulNBits",
        ["hidden", "w", "scales", "zeros", "", "bias"],
        ["logits"],
        domain="com.microsoft",
        name="/lm_head/MatMul_Q8",
        accuracy_level=4,
        **attrs,
    )
    arrays = ((q, "w"), (scales, "scales"), (zeros.reshape(-1), "zeros"), (bias, "bias"))
    inits = [numpy_helper.from_array(a, n) for a, n in arrays]
    graph = helper.make_graph(
        [node],
        "head",
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", "seq", K])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", N])],
        inits,
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    weight = dequantize(attrs, q, scales, zeros.reshape(-1) if bits == 8 else zeros)
    return model, weight.astype(np.float32) if bits == 8 else weight


def run(model: onnx.ModelProto, hidden: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (logits,) = session.run(["logits"], {"hidden": hidden})
    return np.asarray(logits)


def test_head_is_rewritten_onto_the_int8_gemm_and_computes_the_same_product(tmp_path: Path) -> None:
    model, weight = head_model()
    bias = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "bias"))
    assert int8_lm_head(model, tmp_path)
    ops = [node.op_type for node in model.graph.node]
    assert "MatMulNBits" not in ops and "MatMulIntegerToFloat" in ops
    assert {"w", "scales", "zeros"}.isdisjoint(i.name for i in model.graph.initializer)
    hidden = np.random.default_rng(1).standard_normal((3, 2, K)).astype(np.float32)
    got = run(model, hidden)
    want = hidden @ weight.T + bias
    assert got.shape == want.shape
    # int8 rows and columns: the error is a small fraction of the logits' spread
    assert np.abs(got - want).max() < 0.02 * np.abs(want).max()


def test_each_row_gives_the_same_logits_whatever_else_is_in_the_call(tmp_path: Path) -> None:
    model, _ = head_model(seed=2)
    assert int8_lm_head(model, tmp_path)
    spread = np.linspace(0.1, 10, 16, dtype=np.float32)[:, None, None]
    hidden = np.random.default_rng(3).standard_normal((16, 1, K)).astype(np.float32) * spread
    together = run(model, hidden)
    for row in range(16):
        alone = run(model, hidden[row : row + 1])
        assert np.array_equal(alone[0], together[row])  # bit-identical: per-row scales, exact integer product


def test_other_heads_are_left_alone(tmp_path: Path) -> None:
    model, _ = head_model(bits=4)
    before = model.SerializeToString()
    assert not int8_lm_head(model, tmp_path)
    assert model.SerializeToString() == before


def test_column_quantization_round_trips_within_half_a_step() -> None:
    weight = np.random.default_rng(4).standard_normal((N, K)) * np.linspace(0.01, 3, N)[:, None]
    q, scale, zero = quantize_columns(weight)
    assert q.shape == (K, N) and q.dtype == np.uint8
    back = (q.T.astype(np.float64) - zero[:, None]) * scale[:, None]
    assert np.all(np.abs(back - weight) <= scale[:, None] / 2 + 1e-6)


def test_unknown_lm_head_choice_is_refused(tmp_path: Path) -> None:
    from services.edge_worker.graph import load_session

    with pytest.raises(ValueError, match="lm_head 'fp8'"):
        load_session(tmp_path / "model.onnx", ort.SessionOptions(), lm_head="fp8")


def test_outlier_channels_are_computed_in_fp32_and_rows_stay_independent(tmp_path: Path) -> None:
    model, weight = head_model(seed=5)
    bias = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "bias"))
    plain = onnx.ModelProto()
    plain.CopyFrom(model)
    outliers = np.arange(0, K, 4)  # 16 channels, as the engine picks
    assert int8_lm_head(model, tmp_path, outliers)
    assert int8_lm_head(plain, tmp_path)
    hidden = np.random.default_rng(6).standard_normal((16, 1, K)).astype(np.float32)
    hidden[..., outliers] *= 60.0  # a few channels dwarf the rest, as in the real model
    want = hidden @ weight.T + bias
    err_split = np.abs(run(model, hidden) - want).max()
    err_plain = np.abs(run(plain, hidden) - want).max()
    assert err_split < err_plain / 4
    together = run(model, hidden)
    for row in range(16):
        assert np.array_equal(run(model, hidden[row : row + 1])[0], together[row])
