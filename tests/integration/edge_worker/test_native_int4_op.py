"""The onnxruntime custom op ``meshserve.edge:Int4MatMul`` (int4_kernel=native): a MatMulNBits graph edited by
``services.edge_worker.native.graph`` computes, bit for bit, what the kernel computes through ctypes (plus the
bias), for 2-D and 3-D inputs, on one thread or several, and each row whatever else is in the call; with 8-bit
weights (``bits=8``) too, whose results also stay close to onnxruntime's MatMulNBits (MLAS).

Skipped, with the reason, where the kernel cannot be built or run (no gcc, not x86-64 with AVX2, FMA and F16C)."""

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


def _weights(k: int, n: int, seed: int, bits: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    nb = k // 32
    b = rng.integers(0, 256, (n, nb, 4 * bits), dtype=np.uint8)
    scales = rng.uniform(0.005, 0.025, n * nb).astype(np.float32)
    zeros = rng.integers(0, 256, n * ((nb + 1) // 2) if bits == 4 else (n, nb), dtype=np.uint8)
    bias = rng.standard_normal(n).astype(np.float32)
    return b, scales, zeros, bias


def _model(
    k: int, n: int, rank: int, seed: int, with_bias: bool, bits: int = 4
) -> tuple[onnx.ModelProto, tuple[np.ndarray, ...]]:
    b, scales, zeros, bias = _weights(k, n, seed, bits)
    shape: list[str | int] = ["m", k] if rank == 2 else ["batch", "seq", k]
    out_shape: list[str | int] = [*shape[:-1], n]
    inits = [numpy_helper.from_array(b, "B"), numpy_helper.from_array(scales, "S"), numpy_helper.from_array(zeros, "Z")]
    inputs = ["A", "B", "S", "Z"]
    if with_bias:
        inits.append(numpy_helper.from_array(bias, "bias"))
        inputs += ["", "bias"]
    node = helper.make_node(
        "MatMulNBits", inputs, ["Y"], domain="com.microsoft", name="mm", K=k, N=n, bits=bits, block_size=32,
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


def test_only_block_32_nodes_are_replaced() -> None:
    model, _ = _model(64, 16, 2, seed=1, with_bias=False)
    for attr in model.graph.node[0].attribute:
        if attr.name == "block_size":
            attr.i = 16
    assert use_int4_op(model, Path("."), 1) == 0
    assert model.graph.node[0].op_type == "MatMulNBits"


def _activations(m: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)) * rng.uniform(0.01, 100, (m, 1))
    a[min(4, m - 1), :32] = 0  # a block of zeros: its scale is 0
    a[min(9, m - 1), 40] = 1e4  # one large value: the rest of its block quantizes to 0
    return a.astype(np.float32)


@pytest.mark.parametrize(("k", "n", "threads"), [(64, 16, 1), (576, 960, 2), (1536, 576, 2)])
def test_8_bit_weights_equal_the_kernel_and_stay_close_to_mlas(library: Path, k: int, n: int, threads: int) -> None:
    model, (b, scales, zeros, bias) = _model(k, n, 2, seed=k + n, with_bias=True, bits=8)
    mlas = _session(model, library, threads)
    assert use_int4_op(model, Path("."), threads) == 1
    (node,) = model.graph.node
    assert (node.domain, node.op_type) == (DOMAIN, OP)
    assert {a.name: a.i for a in node.attribute}["bits"] == 8
    native = _session(model, library, threads)
    reference = Int4MatMul(load_kernel(library.parent), b, scales, zeros, k, n, bits=8)
    # the exact quantized math in float64: activations quantized as the kernel does, integer dots, then scales
    a = _activations(16, k, seed=n)
    qa, sa, _ = reference.quantize(a)
    nb = k // 32
    qw = b.reshape(n, nb, 32).astype(np.int64) - zeros.reshape(n, nb, 1).astype(np.int64)
    dots = np.einsum("mbk,nbk->mnb", qa.reshape(16, nb, 32).astype(np.int64), qw).astype(np.float64)
    exact = np.einsum("mnb,mb,nb->mn", dots, sa.astype(np.float64), scales.reshape(n, nb).astype(np.float64)) + bias
    for m in (1, 2, 3, 16):
        (y,) = native.run(None, {"A": a[:m]})
        assert np.array_equal(y, reference(a[:m]) + bias)  # the op: the ctypes kernel plus the bias, bit for bit
        assert np.abs(y - exact[:m]).max() <= 1e-5 * np.abs(exact[:m]).max()  # fp32 sums of the exact products
        (expected,) = mlas.run(None, {"A": a[:m]})
        diff = np.abs(y - expected).max() / np.abs(expected).max()
        print(f"8-bit K={k} N={n} M={m}: max |native - mlas| / max |mlas| = {diff:.2e}")
        assert diff <= 1e-5


def test_8_bit_rows_are_bit_identical_whatever_rows_come_with_them(library: Path) -> None:
    k, n = 576, 960
    model, _ = _model(k, n, 2, seed=7, with_bias=True, bits=8)
    assert use_int4_op(model, Path("."), 2) == 1
    session = _session(model, library, 2)
    a = _activations(16, k, seed=3)
    alone = np.stack([session.run(None, {"A": a[i : i + 1]})[0][0] for i in range(16)]).view(np.uint32)
    for m in range(1, 17):
        for start in range(17 - m):
            (together,) = session.run(None, {"A": a[start : start + m]})
            assert np.array_equal(together.view(np.uint32), alone[start : start + m]), (m, start)


def _unpack_4_bit(b: np.ndarray, zeros: np.ndarray, n: int, nb: int) -> np.ndarray:
    """MatMulNBits' 4-bit weights minus their zero points, [n, nb, 32] (low nibble first, zero points likewise)."""
    q = np.stack([b & 15, b >> 4], axis=-1).reshape(n, nb, 32).astype(np.int64)
    z = np.stack([zeros & 15, zeros >> 4], axis=-1).reshape(n, -1)[:, :nb].astype(np.int64)
    return q - z[:, :, None]


@pytest.mark.parametrize(("k", "n", "threads"), [(576, 72, 1), (576, 1536, 2), (1536, 40, 1)])
def test_4_bit_rows_are_exact_and_bit_identical_whatever_rows_come_with_them(
    library: Path, k: int, n: int, threads: int
) -> None:
    # n = 72 and 40 on one thread: chunks of 3 and 2 column groups, so the two-group tiles (3 rows and more),
    # the one-group tail and the leftover rows of every tile size all run
    model, (b, scales, zeros, bias) = _model(k, n, 2, seed=k + n, with_bias=True)
    assert use_int4_op(model, Path("."), threads) == 1
    session = _session(model, library, threads)
    reference = Int4MatMul(load_kernel(library.parent), b, scales, zeros, k, n)
    a = _activations(16, k, seed=n)
    qa, sa, _ = reference.quantize(a)
    nb = k // 32
    qw = _unpack_4_bit(b, zeros, n, nb)
    dots = np.einsum("mbk,nbk->mnb", qa.reshape(16, nb, 32).astype(np.int64), qw).astype(np.float64)
    sw = scales.reshape(n, nb).astype(np.float16).astype(np.float64)  # the kernel keeps 4-bit scales in fp16
    exact = np.einsum("mnb,mb,nb->mn", dots, sa.astype(np.float64), sw) + bias
    alone = np.stack([session.run(None, {"A": a[i : i + 1]})[0][0] for i in range(16)])
    assert np.abs(alone - exact).max() <= 1e-5 * np.abs(exact).max()  # fp32 sums of the exact products
    for m in range(1, 17):
        for start in range(0, 17 - m, 3):
            (together,) = session.run(None, {"A": a[start : start + m]})
            assert np.array_equal(together.view(np.uint32), alone[start : start + m].view(np.uint32)), (m, start)


def test_weights_of_the_wrong_packed_size_are_an_error_not_a_wild_read(library: Path) -> None:
    model, _ = _model(64, 16, 2, seed=2, with_bias=False, bits=8)
    assert use_int4_op(model, Path("."), 1) == 1
    for attr in model.graph.node[0].attribute:
        if attr.name == "bits":
            attr.i = 4  # the 8-bit layout is larger than what the op now expects
    session = _session(model, library)
    with pytest.raises(Exception, match="W's size is not the packed size of K, N and bits"):
        session.run(None, {"A": np.ones((2, 64), np.float32)})


def test_the_lm_head_is_never_replaced() -> None:
    model, _ = _model(64, 16, 2, seed=1, with_bias=False, bits=8)
    model.graph.node[0].output[0] = "logits"
    model.graph.output[0].name = "logits"
    assert use_int4_op(model, Path("."), 1) == 0


def test_8_bit_extremes_do_not_saturate(library: Path) -> None:
    # weights 0 and 255 (shifted: -128 and 127) against activations that all quantize to +-127: the largest
    # pair sums the int16 products can meet (2 x 128 x 127 = 32512); the result must still be the exact math
    k, n = 128, 16
    rng = np.random.default_rng(4)
    b = rng.choice(np.array([0, 255], np.uint8), (n, k // 32, 32))
    b[0] = 0  # a whole column of -128s
    scales = np.full(n * (k // 32), 0.01, np.float32)
    zeros = rng.integers(0, 256, (n, k // 32), dtype=np.uint8)
    reference = Int4MatMul(load_kernel(library.parent), b, scales, zeros, k, n, bits=8)
    a = np.where(rng.random((4, k)) < 0.5, -3.0, 3.0).astype(np.float32)
    a[1] = -3.0  # every product of column 0 at the extreme, one sign
    qa, sa, _ = reference.quantize(a)
    assert np.abs(qa).min() == 127
    w = b.reshape(n, k).astype(np.int64) - np.repeat(zeros.astype(np.int64), 32, axis=1)
    exact = (qa.astype(np.int64) * sa.repeat(32, axis=1).astype(np.float64)) @ (w * 0.01).T
    y = reference(a)
    assert np.abs(y - exact).max() <= 1e-5 * np.abs(exact).max()
