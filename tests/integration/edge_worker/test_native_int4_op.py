"""The onnxruntime custom op ``meshserve.edge:Int4MatMul`` (int4_kernel=native): a MatMulNBits graph edited by
``services.edge_worker.native.graph`` computes, bit for bit, what the kernel computes through ctypes (plus the
bias), for 2-D and 3-D inputs, on one thread or several, and each row whatever else is in the call.

Skipped, with the reason, where the kernel cannot be built or run (no gcc, not x86-64 with AVX2 + FMA)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from services.edge_worker.native.graph import DOMAIN, OP, use_int4_op
from services.edge_worker.native.kernel import Int4MatMul, compile_kernel, load_kernel, unavailable_reason

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or ""),
]


def _weights(k: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    nb = k // 32
    b = rng.integers(0, 256, (n, nb, 16), dtype=np.uint8)
    scales = rng.uniform(0.005, 0.025, n * nb).astype(np.float32)
    zeros = rng.integers(0, 256, n * ((nb + 1) // 2), dtype=np.uint8)
    bias = rng.standard_normal(n).astype(np.float32)
    return b, scales, zeros, bias


def _model(k: int, n: int, rank: int, seed: int, with_bias: bool) -> tuple[onnx.ModelProto, tuple[np.ndarray, ...]]:
    b, scales, zeros, bias = _weights(k, n, seed)
    shape: list[str | int] = ["m", k] if rank == 2 else ["batch", "seq", k]
    out_shape: list[str | int] = [*shape[:-1], n]
    inits = [numpy_helper.from_array(b, "B"), numpy_helper.from_array(scales, "S"), numpy_helper.from_array(zeros, "Z")]
    inputs = ["A", "B", "S", "Z"]
    if with_bias:
        inits.append(numpy_helper.from_array(bias, "bias"))
        inputs += ["", "bias"]
    node = helper.make_node(
        "MatMulNBits", inputs, ["Y"], domain="com.microsoft", name="mm", K=k, N=n, bits=4, block_size=32,
        accuracy_level=4,
    )  # fmt: skip
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, out_shape)],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)], ir_version=10
    )
    return model, (b, scales, zeros, bias if with_bias else np.zeros(n, np.float32))


def _session(model: onnx.ModelProto, library: Path, threads: int = 1) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_kernel(tmp_path_factory.mktemp("int4-op"))


def test_the_ort_api_positions_used_round_trip(library: Path) -> None:
    lib = ctypes.CDLL(str(library))
    ort_lib = ctypes.CDLL(str(next(Path(ort.__file__).parent.glob("capi/libonnxruntime.so*"))))
    ort_lib.OrtGetApiBase.restype = ctypes.c_void_p
    lib.ort_api_check.argtypes = [ctypes.c_void_p]
    assert lib.ort_api_check(ort_lib.OrtGetApiBase()) == 1


@pytest.mark.parametrize(
    ("k", "n", "rank", "with_bias", "threads"),
    [(64, 16, 2, False, 1), (128, 48, 3, True, 1), (576, 960, 3, True, 2), (1536, 576, 2, True, 3)],
)
def test_the_op_equals_the_kernel(library: Path, k: int, n: int, rank: int, with_bias: bool, threads: int) -> None:
    model, (b, scales, zeros, bias) = _model(k, n, rank, seed=k + n, with_bias=with_bias)
    assert use_int4_op(model, Path("."), threads) == 1
    (node,) = model.graph.node
    assert (node.domain, node.op_type) == (DOMAIN, OP)
    session = _session(model, library, threads)
    reference = Int4MatMul(load_kernel(library.parent), b, scales, zeros, k, n)
    rng = np.random.default_rng(5)
    a = (rng.standard_normal((2, 3, k)) * rng.uniform(0.1, 10, (2, 3, 1))).astype(np.float32)
    if rank == 2:
        a = a.reshape(6, k)
    (y,) = session.run(None, {"A": a})
    assert y.shape == (*a.shape[:-1], n)
    expected = reference(a.reshape(-1, k)) + bias  # the op adds the bias after the product, in fp32
    assert np.array_equal(y.reshape(-1, n), expected)
    # each row alone is the same row as in the call of six
    for row in range(6):
        alone = a.reshape(-1, k)[row : row + 1].reshape((1, 1, k) if rank == 3 else (1, k))
        (y1,) = session.run(None, {"A": alone})
        assert np.array_equal(y1.reshape(n), y.reshape(-1, n)[row])


def test_only_4_bit_block_32_nodes_are_replaced() -> None:
    model, _ = _model(64, 16, 2, seed=1, with_bias=False)
    for attr in model.graph.node[0].attribute:
        if attr.name == "block_size":
            attr.i = 16
    assert use_int4_op(model, Path("."), 1) == 0
    assert model.graph.node[0].op_type == "MatMulNBits"
