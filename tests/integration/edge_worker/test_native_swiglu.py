"""The MLP's gate and up projections and their SwiGLU fused into one ``Int4MatMul`` (``act=1``,
services/edge_worker/native/swiglu_graph.py): the same output as the five nodes it replaces (up to the
activation's rounding), rows independent of each other bit for bit, and only the exact pattern fused.

Skipped, with the reason, where the kernel cannot be built or run (no gcc, not x86-64 with AVX2, FMA and F16C)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from services.edge_worker.native.graph import DOMAIN, OP
from services.edge_worker.native.kernel import compile_kernel, pack_weights, unavailable_reason
from services.edge_worker.native.swiglu_graph import use_swiglu_op

pytestmark = [
    pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or ""),
]

K, N = 576, 1536  # the model's MLP shapes


def _mlp(rng: np.random.Generator, extra_output: bool = False) -> onnx.ModelProto:
    def packed(name: str) -> onnx.TensorProto:
        b = rng.integers(0, 256, (N, K // 32, 16), dtype=np.uint8)
        z = rng.integers(0, 256, (N * (K // 32) + 1) // 2, dtype=np.uint8)
        scales = rng.random(N * (K // 32), dtype=np.float32) * 0.02
        return numpy_helper.from_array(pack_weights(b, scales, z, K, N), name)

    inits = [packed("wg"), packed("wu")]
    inits += [numpy_helper.from_array(rng.standard_normal(N).astype(np.float32) * 0.1, name) for name in ("bg", "bu")]
    nodes = [
        helper.make_node(OP, ["x", "wg", "bg"], ["G"], domain=DOMAIN, K=K, N=N, threads=2, bits=4),
        helper.make_node(OP, ["x", "wu", "bu"], ["U"], domain=DOMAIN, K=K, N=N, threads=2, bits=4),
        helper.make_node("Sigmoid", ["G"], ["S"]),
        helper.make_node("Mul", ["G", "S"], ["A"]),
        helper.make_node("Mul", ["A", "U"], ["Y"]),
    ]
    outputs = [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", N])]
    if extra_output:  # the gate's output is needed elsewhere: nothing may be fused
        outputs.append(helper.make_tensor_value_info("G", TensorProto.FLOAT, ["M", N]))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])]
    graph = helper.make_graph(nodes, "mlp", inputs, outputs, inits)
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)], ir_version=10
    )


def _session(model: onnx.ModelProto, threads: int = 2) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(compile_kernel()))
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def test_fused_equals_the_five_nodes_and_rows_are_independent() -> None:
    rng = np.random.default_rng(7)
    model = _mlp(rng)
    x = (rng.standard_normal((6, K)) * 2).astype(np.float32)
    plain = _session(model).run(["Y"], {"x": x})[0]
    assert use_swiglu_op(model) == 1
    assert [(node.op_type, {a.name: a.i for a in node.attribute}.get("act")) for node in model.graph.node] == [(OP, 1)]
    assert {init.name for init in model.graph.initializer} == {"wg/swiglu", "bg/swiglu"}  # the old ones dropped
    fused = _session(model)
    got = fused.run(["Y"], {"x": x})[0]
    # the same quantized products; only exp's rounding differs from onnxruntime's Sigmoid
    assert np.abs(got - plain).max() <= 1e-5 * np.abs(plain).max()
    for threads in (1, 3):
        for m in range(6):  # a row alone, at any thread count, is the same bits as in the call of six
            assert np.array_equal(_session(model, threads).run(["Y"], {"x": x[m : m + 1]})[0][0], got[m])


def test_only_the_exact_pattern_is_fused() -> None:
    model = _mlp(np.random.default_rng(1), extra_output=True)
    assert use_swiglu_op(model) == 0 and len(model.graph.node) == 5
