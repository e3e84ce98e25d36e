"""``meshserve bench edge-int4-kernel``: wired into the CLI, its weight packing follows the layout kq4.c
documents, it says in one sentence why the kernel cannot run, and its report has the tables and no TARGET."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks import cli as bench_cli
from benchmarks.edge.int4_kernel import bench
from services.edge_worker.native import kernel


def test_edge_int4_kernel_is_a_bench_subcommand() -> None:
    assert bench_cli.SUBCOMMANDS["edge-int4-kernel"][0] == "benchmarks.edge.int4_kernel.bench"


def _matmulnbits(q: np.ndarray, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q [N, K], z [N, K/32] (values 0..15) packed as MatMulNBits' B and zero points."""
    n, k = q.shape
    nb = k // 32
    pairs = q.reshape(n, nb, 16, 2)
    zz = np.zeros((n, 2 * ((nb + 1) // 2)), np.uint8)
    zz[:, :nb] = z
    return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8), (zz[:, 0::2] | (zz[:, 1::2] << 4)).reshape(-1)


def test_packing_puts_each_weight_where_the_kernel_reads_it() -> None:
    k, n = 96, 16  # 3 blocks (an odd count: the last zero-point byte is half used), 2 groups of 8 columns
    rng = np.random.default_rng(0)
    q = rng.integers(0, 16, (n, k), dtype=np.uint8)
    z = rng.integers(0, 16, (n, k // 32), dtype=np.uint8)
    scales = rng.random(n * (k // 32), dtype=np.float32)
    b, zp = _matmulnbits(q, z)
    packed = kernel.pack_weights(b, scales, zp, k, n).reshape(n // 8, k // 32, kernel.GROUP_BYTES)
    assert packed.ctypes.data % 64 == 0
    for g in range(n // 8):
        for blk in range(k // 32):
            block = packed[g, blk]
            for i in range(128):  # byte i of chunk c: column i/4, k = 4c + i%4 and 16 + 4c + i%4
                c, col, kk = i // 32, (i % 32) // 4, i % 4
                column = 8 * g + col
                assert block[i] & 0x0F == q[column, 32 * blk + 4 * c + kk]
                assert block[i] >> 4 == q[column, 32 * blk + 16 + 4 * c + kk]
            sw = block[128:144].view(np.float16)  # the scales rounded to the nearest fp16
            assert np.array_equal(sw, scales.reshape(n, k // 32)[8 * g : 8 * g + 8, blk].astype(np.float16))
            zeros = np.stack([block[144:148] & 0x0F, block[144:148] >> 4], axis=1).reshape(8)  # 2 columns a byte
            assert np.array_equal(zeros, z[8 * g : 8 * g + 8, blk])


def test_scales_too_large_for_fp16_are_refused_with_a_sentence() -> None:
    k, n = 32, 8
    q = np.zeros((n, k), np.uint8)
    b, zp = _matmulnbits(q, np.zeros((n, 1), np.uint8))
    with pytest.raises(ValueError, match="stores them as fp16"):
        kernel.pack_weights(b, np.full(n, 7e4, np.float32), zp, k, n)
    with pytest.raises(ValueError, match="stores them as fp16"):
        kernel.pack_weights(b, np.full(n, np.nan, np.float32), zp, k, n)


def test_8_bit_packing_puts_each_weight_where_the_kernel_reads_it() -> None:
    k, n = 96, 16
    rng = np.random.default_rng(2)
    q = rng.integers(0, 256, (n, k), dtype=np.uint8)
    z = rng.integers(0, 256, (n, k // 32), dtype=np.uint8)
    scales = rng.random(n * (k // 32), dtype=np.float32)
    packed = kernel.pack_weights(q.reshape(n, k // 32, 32), scales, z.reshape(-1), k, n, bits=8)
    assert packed.ctypes.data % 64 == 0
    packed = packed.reshape(n // 8, k // 32, kernel.GROUP_BYTES_8)
    for g in range(n // 8):
        for blk in range(k // 32):
            block = packed[g, blk]
            for i in range(256):  # byte i of chunk c: column i/4, k = 4c + i%4
                c, col, kk = i // 32, (i % 32) // 4, i % 4
                assert block[i] == q[8 * g + col, 32 * blk + 4 * c + kk]
            assert np.array_equal(block[256:288].view(np.float32), scales.reshape(n, k // 32)[8 * g : 8 * g + 8, blk])
            assert np.array_equal(block[288:296], z[8 * g : 8 * g + 8, blk])
    symmetric = kernel.pack_weights(q.reshape(n, k // 32, 32), scales, None, k, n, bits=8)
    assert np.all(symmetric.reshape(n // 8, k // 32, kernel.GROUP_BYTES_8)[..., 288:] == 128)
    with pytest.raises(ValueError, match=r"takes weights of \(4, 8\) bits, got 2"):
        kernel.pack_weights(q.reshape(n, k // 32, 32), scales, None, k, n, bits=2)


def test_unpacking_matmulnbits_inverts_its_packing() -> None:
    rng = np.random.default_rng(1)
    q = rng.integers(0, 16, (8, 64), dtype=np.uint8)
    z = rng.integers(0, 16, (8, 2), dtype=np.uint8)
    b, zp = _matmulnbits(q, z)
    got_q, got_z = kernel.unpack_matmulnbits(b, zp, 64, 8)
    assert np.array_equal(got_q, q) and np.array_equal(got_z, z)
    assert np.array_equal(kernel.unpack_matmulnbits(b, None, 64, 8)[1], np.full((8, 2), 8))


@pytest.mark.parametrize(("k", "n", "match"), [(100, 16, "multiple of 32"), (64, 12, "multiple of 8")])
def test_shapes_the_kernel_cannot_take_are_refused(k: int, n: int, match: str) -> None:
    b = np.zeros((n, max(k // 32, 1), 16), np.uint8)
    with pytest.raises(ValueError, match=match):
        kernel.pack_weights(b, np.zeros(n * max(k // 32, 1), np.float32), None, k, n)


def test_a_machine_without_gcc_or_avx2_gets_one_sentence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(kernel.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(kernel, "cpu_flags", lambda: {"sse2", "fma", "f16c"})
    assert kernel.unavailable_reason() == (
        "the int4 kernel needs AVX2, FMA and F16C, and this CPU lacks avx2 (per /proc/cpuinfo)."
    )
    monkeypatch.setattr(kernel, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.setattr(kernel.shutil, "which", lambda _name: None)
    with pytest.raises(kernel.KernelUnavailable, match=r"^the int4 kernel is compiled with gcc, which is not on PATH"):
        kernel.compile_kernel(tmp_path)
    monkeypatch.setattr(kernel.platform, "machine", lambda: "aarch64")
    assert "needs an x86-64 CPU" in (kernel.unavailable_reason() or "")
    assert bench.main(["--cache-dir", str(tmp_path), "--out", str(tmp_path / "x.md")]) == 2
    assert not (tmp_path / "x.md").exists()


def _report() -> dict[str, Any]:
    shape = {"K": 576, "N": 1536, "M": 1, "ort_us": 70.0, "ort_empty_us": 7.0, "ort_net_us": 63.0,
             "kernel_us": 27.0, "kernel_ctypes_us": 31.0, "speedup": 63.0 / 27.0}  # fmt: skip
    check = {"K": 576, "N": 1536, "rows_compared": 816, "row_mismatches": 0, "ort_rows_differing_m16_vs_alone": 16,
             "ort_max_diff_m16_vs_alone": 2e-4, "max_abs_diff_vs_ort": 1e-4, "max_rel_vs_quantized_reference": 2e-7,
             "max_abs_kernel_vs_float": 4.3, "max_abs_ort_vs_float": 4.3, "max_abs_output": 980.0}  # fmt: skip
    model_row = {"M": 1, "ort_ms": 8.64, "kernel_ms": 7.0, "speedup": 8.64 / 7.0, "ort_ms_range": [7.5, 9.7],
                 "kernel_ms_range": [6.6, 8.0], "max_abs_diff_vs_ort": 7e-6, "kernel_ops_rows_differing_vs_top": 0,
                 "ort_ops_rows_differing_vs_top": 210}  # fmt: skip
    return {
        "command": "meshserve bench edge-int4-kernel",
        "host": {"cpu": "AMD EPYC", "cores": "2", "onnxruntime": "1.31.1", "gcc": "12.2.0", "l3_cache": "32768K"},
        "load_average_start": "1.24, 1.11, 1.05",
        "load_average_after_shapes": "1.30, 1.12, 1.05",
        "load_average_end": "1.46, 1.17, 1.07",
        "rounds": 7,
        "shapes": [shape],
        "checks": [check],
        "model": {
            "layers": 30,
            "matmuls": 210,
            "top_m": 16,
            "weight_mb_matmulnbits": 68.0,
            "weight_mb_kernel": 69.7,
            "rounds": 9,
            "reps": 5,
            "rows": [model_row],
        },
    }


def test_the_report_has_the_shape_step_and_check_tables_and_no_target() -> None:
    text = bench.markdown(_report())
    assert "| 576 x 1536 | 1 | 70.00 | 7.00 | 63.00 | 27.00 | 31.00 | 2.33x |" in text
    assert "| 1 | 8.64 (7.50..9.70) | 7.00 (6.60..8.00) | 1.23x | 7.00e-06 |" in text
    assert "816 rows" in text and "**0 mismatches**" in text
    assert "M=1: kernel 0, onnxruntime 210" in text
    assert "| 576 x 1536 | 16/16 (max 2.0e-04) | 1.0e-04 | 2.0e-07 | 4.3e+00 | 4.3e+00 | 980.0 |" in text
    assert "1.24, 1.11, 1.05 at the start" in text and "1.46, 1.17, 1.07 at the end" in text
    assert "Command: `meshserve bench edge-int4-kernel`" in text
    assert "TARGET" not in text


def test_a_library_built_earlier_is_used_without_gcc(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(kernel.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(kernel, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.setattr(kernel.shutil, "which", lambda _name: None)
    prebuilt = kernel.library_path(tmp_path)  # what `python -m services.edge_worker.native.kernel` leaves
    prebuilt.write_bytes(b"")
    assert kernel.compile_kernel(tmp_path) == prebuilt
    monkeypatch.setattr(kernel, "cpu_flags", lambda: {"sse2"})  # the CPU still has to run it
    with pytest.raises(kernel.KernelUnavailable, match="lacks avx2, f16c, fma"):
        kernel.compile_kernel(tmp_path)
