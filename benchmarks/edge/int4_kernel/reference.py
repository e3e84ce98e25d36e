"""What the int4 kernel is checked and timed against: onnxruntime's MatMulNBits and a numpy replica of its math.

:func:`random_weights` makes MatMulNBits-format weights (4 bits, blocks of 32, asymmetric zero points);
:func:`matmulnbits_model` builds an onnxruntime graph of MatMulNBits nodes over them (accuracy level 4:
int8 activations, as the edge model's nodes) and :func:`one_thread_session` runs it on one thread;
:func:`quantize_activations` and :func:`quantized_reference` replicate the kernel's quantized math in
numpy (float64 sums), :func:`float_reference` is the unquantized product.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from services.edge_worker.native.kernel import BLOCK, unpack_matmulnbits


@dataclass(frozen=True)
class Weights:
    """One weight matrix in MatMulNBits format (the inputs B, scales and zero_points of the node)."""

    k: int
    n: int
    b: npt.NDArray[np.uint8]
    """uint8 [N, K/32, 16]."""
    scales: npt.NDArray[np.float32]
    """float32 [N * K/32]."""
    zero_points: npt.NDArray[np.uint8]
    """uint8 [N * ceil(K/32 / 2)], two 4-bit zero points per byte."""


def random_weights(k: int, n: int, seed: int) -> Weights:
    """Random 4-bit weights, zero points 0..15, scales 0.005..0.025."""
    rng = np.random.default_rng(seed)
    nb = k // BLOCK
    q = rng.integers(0, 16, size=(n, nb, BLOCK // 2, 2), dtype=np.uint8)
    z = np.zeros((n, 2 * ((nb + 1) // 2)), np.uint8)
    z[:, :nb] = rng.integers(0, 16, size=(n, nb), dtype=np.uint8)
    scales = (rng.random((n, nb), dtype=np.float32) * np.float32(0.02) + np.float32(0.005)).astype(np.float32)
    return Weights(
        k=k,
        n=n,
        b=(q[..., 0] | (q[..., 1] << 4)).astype(np.uint8),
        scales=scales.reshape(-1),
        zero_points=(z[:, 0::2] | (z[:, 1::2] << 4)).astype(np.uint8).reshape(-1),
    )


def matmulnbits_model(weights: Sequence[Weights], input_for: dict[int, str] | None = None) -> bytes:
    """A graph with one MatMulNBits node per weight matrix (output ``Y<i>``), serialized.

    ``input_for`` names the graph input of each K (default ``A<K>``); nodes with the same K share it.
    """
    names = input_for or {w.k: f"A{w.k}" for w in weights}
    nodes, initializers, outputs = [], [], []
    for i, w in enumerate(weights):
        initializers += [
            numpy_helper.from_array(w.b, f"B{i}"),
            numpy_helper.from_array(w.scales, f"S{i}"),
            numpy_helper.from_array(w.zero_points, f"Z{i}"),
        ]
        nodes.append(
            helper.make_node(
                "MatMulNBits", [names[w.k], f"B{i}", f"S{i}", f"Z{i}"], [f"Y{i}"], domain="com.microsoft",
                K=w.k, N=w.n, bits=4, block_size=BLOCK, accuracy_level=4,
            )
        )  # fmt: skip
        outputs.append(helper.make_tensor_value_info(f"Y{i}", TensorProto.FLOAT, ["M", w.n]))
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["M", k]) for k, name in sorted(names.items())]
    graph = helper.make_graph(nodes, "int4_matmuls", inputs, outputs, initializer=initializers)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 9
    return bytes(model.SerializeToString())


def relu_model(k: int) -> bytes:
    """One Relu over A [M, K]: the cost of an onnxruntime run with (almost) nothing in it."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["A"], ["Y"])],
        "relu",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", k])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


def one_thread_session(model: bytes) -> ort.InferenceSession:
    """A CPU session on one thread, threads not spinning (as one thread of the edge engine)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def quantize_activations(a: npt.NDArray[np.float32]) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.float32]]:
    """The kernel's activation quantization in numpy (fp32 ops): int8 values [M, K/32, 32], scales [M, K/32]."""
    m, k = a.shape
    blocks = a.reshape(m, k // BLOCK, BLOCK).astype(np.float32)
    amax = np.abs(blocks).max(axis=2)
    safe = np.where(amax > 0, amax, np.float32(1))
    inv = np.where(amax > 0, np.float32(127.0) / safe, np.float32(0)).astype(np.float32)
    qa = np.rint(blocks * inv[..., None]).astype(np.int32)
    return qa, (amax / np.float32(127.0)).astype(np.float32)


def quantized_reference(a: npt.NDArray[np.float32], w: Weights) -> npt.NDArray[np.float64]:
    """The kernel's quantized math in float64: sum over blocks of exact int dots x scales (rounding aside)."""
    qa, sa = quantize_activations(a)
    q, z = unpack_matmulnbits(w.b, w.zero_points, w.k, w.n)
    nb = w.k // BLOCK
    qw = q.reshape(w.n, nb, BLOCK).astype(np.int64) - z.astype(np.int64)[..., None]
    dots = np.einsum("mbk,nbk->mnb", qa.astype(np.int64), qw).astype(np.float64)
    scales = w.scales.reshape(w.n, nb).astype(np.float16).astype(np.float64)  # the kernel keeps fp16 scales
    return np.asarray(np.einsum("mnb,mb,nb->mn", dots, sa.astype(np.float64), scales))


def float_reference(a: npt.NDArray[np.float32], w: Weights) -> npt.NDArray[np.float64]:
    """A @ dequantized W^T in float64, activations not quantized."""
    q, z = unpack_matmulnbits(w.b, w.zero_points, w.k, w.n)
    nb = w.k // BLOCK
    scales = w.scales.reshape(w.n, nb, 1).astype(np.float64)
    dequantized = ((q.reshape(w.n, nb, BLOCK).astype(np.float64) - z[..., None]) * scales).reshape(w.n, w.k)
    return np.asarray(a.astype(np.float64) @ dequantized.T)
