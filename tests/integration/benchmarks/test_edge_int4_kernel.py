"""benchmarks/edge/int4_kernel compiled with gcc and run: row-invariant bit for bit, the same quantized math as
its numpy replica, close to onnxruntime's MatMulNBits; and the benchmark runs end to end, tiny.

Skipped, with the reason, where the kernel cannot be built or run (no gcc, not x86-64 with AVX2, FMA and F16C)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.edge.int4_kernel import bench
from benchmarks.edge.int4_kernel.reference import (
    Weights,
    matmulnbits_model,
    one_thread_session,
    quantize_activations,
    quantized_reference,
    random_weights,
)
from services.edge_worker.native.kernel import Int4MatMul, Kernel, load_kernel, unavailable_reason

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or ""),
]

K, N = 128, 48  # small, but several blocks along K and several groups of 8 columns


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("int4-kernel")


@pytest.fixture(scope="module")
def kernel(cache_dir: Path) -> Kernel:
    return load_kernel(cache_dir)


@pytest.fixture(scope="module")
def weights() -> Weights:
    return random_weights(K, N, seed=3)


def _rows(k: int) -> np.ndarray:
    rng = np.random.default_rng(11)
    rows = rng.standard_normal((16, k)) * rng.uniform(0.01, 100, (16, 1))
    rows[4, :32] = 0  # a block of zeros: its scale is 0
    rows[9, 40] = 1e4  # one large value: the rest of its block quantizes to 0
    return rows.astype(np.float32)


def test_it_compiles_once_into_the_cache(kernel: Kernel, cache_dir: Path) -> None:
    built = kernel.path.stat().st_mtime_ns
    again = load_kernel(cache_dir)
    assert again.path == kernel.path and kernel.path.parent == cache_dir
    assert kernel.path.stat().st_mtime_ns == built
    assert [p.name for p in cache_dir.iterdir()] == [kernel.path.name]  # no temporary file left behind


def test_every_row_is_bit_identical_whatever_rows_come_with_it(kernel: Kernel, weights: Weights) -> None:
    mm = Int4MatMul(kernel, weights.b, weights.scales, weights.zero_points, K, N)
    rows = _rows(K)
    alone = np.stack([mm(rows[i : i + 1])[0] for i in range(16)]).view(np.uint32)
    for m in range(1, 17):
        for start in range(17 - m):
            together = mm(rows[start : start + m]).view(np.uint32)
            assert np.array_equal(together, alone[start : start + m]), (m, start)


def test_it_computes_the_quantized_math_of_its_numpy_replica(kernel: Kernel, weights: Weights) -> None:
    mm = Int4MatMul(kernel, weights.b, weights.scales, weights.zero_points, K, N)
    rows = _rows(K)
    qa, sa, sasum = mm.quantize(rows)
    ref_qa, ref_sa = quantize_activations(rows)
    assert np.array_equal(qa.reshape(ref_qa.shape), ref_qa)  # the activation quantization: exactly
    assert np.array_equal(sa, ref_sa)
    assert np.array_equal(sasum, sa * ref_qa.sum(axis=2).astype(np.float32))
    for m in (1, 2, 5, 16):
        y, ref = mm(rows[:m]), quantized_reference(rows[:m], weights)
        assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()  # fp32 sums against float64 ones


def test_it_agrees_with_onnxruntime_matmulnbits(kernel: Kernel, weights: Weights) -> None:
    mm = Int4MatMul(kernel, weights.b, weights.scales, weights.zero_points, K, N)
    # the kernel keeps 4-bit scales in fp16: onnxruntime given the same rounded scales computes the same product
    rounded = dataclasses.replace(weights, scales=weights.scales.astype(np.float16).astype(np.float32))
    session = one_thread_session(matmulnbits_model([rounded]))
    as_built = one_thread_session(matmulnbits_model([weights]))
    rows = _rows(K)
    for m in (1, 2, 16):
        y = mm(rows[:m])
        expected = session.run(None, {f"A{K}": rows[:m]})[0]
        assert np.abs(y - expected).max() <= 1e-5 * np.abs(expected).max()
        # and against the scales as built: each block's scale moves by at most 2^-11 of itself
        built = as_built.run(None, {f"A{K}": rows[:m]})[0]
        assert np.abs(y - built).max() <= 2**-11 * np.abs(built).max() * 2


def test_symmetric_weights_without_zero_points_use_eight(kernel: Kernel, weights: Weights) -> None:
    eights = np.full_like(weights.zero_points, 0x88)
    a = _rows(K)[:3]
    without = Int4MatMul(kernel, weights.b, weights.scales, None, K, N)(a)
    with_eights = Int4MatMul(kernel, weights.b, weights.scales, eights, K, N)(a)
    assert np.array_equal(without, with_eights)


def test_a_wrong_activation_shape_is_a_clear_error(kernel: Kernel, weights: Weights) -> None:
    mm = Int4MatMul(kernel, weights.b, weights.scales, weights.zero_points, K, N)
    with pytest.raises(ValueError, match=r"A must be \[M, 128\]"):
        mm(np.zeros((2, 64), np.float32))


def test_the_benchmark_runs_and_writes_its_report(tmp_path: Path, cache_dir: Path) -> None:
    out = tmp_path / "edge_int4_kernel.md"
    args = ["--ms", "1", "2", "--rounds", "1", "--batch-seconds", "0.001", "--layers", "1", "--model-rounds", "1",
            "--model-reps", "1", "--cache-dir", str(cache_dir), "--out", str(out)]  # fmt: skip
    assert bench.main(args) == 0
    page = out.read_text()
    assert "| 576 x 1536 | 1 |" in page and "Load average" in page and "TARGET" not in page
    report = json.loads(out.with_suffix(".json").read_text())
    assert [(r["K"], r["N"], r["M"]) for r in report["shapes"]][:2] == [(576, 1536, 1), (576, 1536, 2)]
    assert sum(c["row_mismatches"] for c in report["checks"]) == 0
    assert [r["kernel_ops_rows_differing_vs_top"] for r in report["model"]["rows"]] == [0, 0]
    assert report["model"]["matmuls"] == 7
