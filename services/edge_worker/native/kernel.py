"""Build, load and call ``kq4.c``: a row-invariant matmul of 4- or 8-bit MatMulNBits weights x int8 activations (AVX2).

Our own code because onnxruntime's MLAS has no row-invariant 4-bit kernel (its M=1 GEMV rounds
differently from its M>=2 GEMM, docs/edge.md, issue 27) and measured slower on this CPU; the layout
and the quantized math are in the C file's header. :func:`load_kernel` compiles the sources with gcc
once into a cache directory (the file name hashes the sources and the flags), loads it with ctypes and
checks the CPU has AVX2, FMA and F16C; :func:`pack_weights` turns MatMulNBits-format weights into the
kernel's layout (4 or 8 bits); :class:`Int4MatMul` runs it. The same library holds the onnxruntime custom op
``meshserve.edge:Int4MatMul`` (``int4op.c``) that the batched edge engine uses with
``int4_kernel=native`` (:func:`custom_op_library`, :mod:`services.edge_worker.native.graph`); the
benchmark ``meshserve bench edge-int4-kernel`` imports this module.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

SOURCE = Path(__file__).with_name("kq4.c")
SOURCES = (SOURCE, Path(__file__).with_name("int4op.c"), Path(__file__).with_name("attn.c"))
HEADERS = (Path(__file__).with_name("ortapi.h"), Path(__file__).with_name("avxmath.h"))
"""Included by the sources (the onnxruntime C API declarations, the vector exp both ops use): part of the
library's name, not of gcc's command."""
"""Compiled into one library: the kernel, the onnxruntime custom op over it and the attention op (``attn.c``)."""
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fPIC", "-shared", "-Wl,-z,defs")
"""``-z defs``: a symbol left undefined (a source missing from the build) fails the build, not the load."""
LIBS: tuple[str, ...] = ("-lm",)
BLOCK = 32
"""Weights are quantized in blocks of 32 along K (MatMulNBits ``block_size=32``)."""
GROUP_COLUMNS = 8
"""The kernel computes 8 output columns at a time, so N must be a multiple of 8."""
GROUP_BYTES = 148
"""Bytes per block of 8 columns x 32 k in the packed layout (128 nibble bytes, 8 fp16 scales, 8 4-bit zero points)."""
FP16_MAX = 65504.0
"""The largest finite fp16: 4-bit scales are stored as fp16 (nearest), so larger ones cannot be packed."""
GROUP_BYTES_8 = 296
"""The same for 8-bit weights (256 weight bytes, 8 fp32 scales, 8 u8 zero points)."""
BITS = (4, 8)
"""The weight widths the kernel takes."""

_P = ctypes.c_void_p
_I = ctypes.c_int


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or run here (no gcc, not x86-64, no AVX2/FMA/F16C, or the build failed)."""


def kernel_threads(intra_op_threads: int) -> int:
    """The native kernel's threads for a session of ``intra_op_threads`` (0, onnxruntime's default: one
    per core)."""
    return intra_op_threads or os.cpu_count() or 1


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "meshserve" / "int4-kernel"


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty when the file is not there)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def unavailable_reason() -> str | None:
    """Why the kernel cannot be built and run on this machine (one sentence), or None when it can."""
    return _cpu_reason() or _gcc_reason()


def _gcc_reason() -> str | None:
    if shutil.which("gcc") is None:
        return "the int4 kernel is compiled with gcc, which is not on PATH: install gcc (e.g. apt-get install gcc)."
    return None


def _cpu_reason() -> str | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the int4 kernel needs an x86-64 CPU with AVX2, FMA and F16C, this machine is {platform.machine()}."
    missing = {"avx2", "fma", "f16c"} - cpu_flags()
    if missing:
        return (
            f"the int4 kernel needs AVX2, FMA and F16C, and this CPU lacks {', '.join(sorted(missing))}"
            " (per /proc/cpuinfo)."
        )
    return None


def library_path(cache_dir: Path | None = None) -> Path:
    """Where the library built from these sources and flags is (or will be) kept."""
    source = b"\0".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    digest = hashlib.sha256(source + "\0".join(CFLAGS + LIBS).encode()).hexdigest()[:16]
    return (cache_dir or default_cache_dir()) / f"kq4-{digest}.so"


def compile_kernel(cache_dir: Path | None = None) -> Path:
    """The shared library built from :data:`SOURCES`; compiled only when the cache lacks these sources + flags
    (a library built earlier, e.g. into the Docker image, needs no gcc here)."""
    reason = _cpu_reason()
    if reason is not None:
        raise KernelUnavailable(reason)
    library = library_path(cache_dir)
    directory = library.parent
    if library.exists():
        return library
    reason = _gcc_reason()
    if reason is not None:
        raise KernelUnavailable(reason)
    directory.mkdir(parents=True, exist_ok=True)
    # build under a temporary name and rename: another process may be building the same file
    fd, tmp = tempfile.mkstemp(prefix=".kq4-", suffix=".so", dir=directory)
    os.close(fd)
    try:
        command = ["gcc", *CFLAGS, "-o", tmp, *map(str, SOURCES), *LIBS]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            names = " and ".join(path.name for path in SOURCES)
            raise KernelUnavailable(f"gcc could not build {names}: {done.stderr.strip()[:2000]}")
        os.replace(tmp, library)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return library


@dataclass(frozen=True)
class Kernel:
    """The loaded library; its functions take raw pointers (see kq4.c)."""

    lib: ctypes.CDLL
    path: Path


def load_kernel(cache_dir: Path | None = None) -> Kernel:
    """Compile (once) and load the kernel; raises :class:`KernelUnavailable` with the reason when it cannot."""
    path = compile_kernel(cache_dir)
    lib = ctypes.CDLL(str(path))
    lib.grp_bytes.restype = _I
    lib.grp8_bytes.restype = _I
    lib.quantize_rows.argtypes = [_P, _I, _I, _P, _P, _P]
    lib.quantize_rows.restype = None
    lib.matmul_q4.argtypes = [_P, _I, _I, _P, _I, _P, _P, _P, _P]
    lib.matmul_q4.restype = None
    lib.matmul_q8.argtypes = [_P, _I, _I, _P, _I, _P, _P, _P, _P]
    lib.matmul_q8.restype = None
    lib.time_matmul_q4.argtypes = [_I, _P, _I, _I, _P, _I, _P, _P, _P, _P]
    lib.time_matmul_q4.restype = ctypes.c_double
    lib.time_matmul_q8.argtypes = lib.time_matmul_q4.argtypes
    lib.time_matmul_q8.restype = ctypes.c_double
    lib.time_matmul_q4_list.argtypes = [_I, _I, _P, _P, _P, _P, _P, _I, _P, _P, _P]
    lib.time_matmul_q4_list.restype = ctypes.c_double
    if (lib.grp_bytes(), lib.grp8_bytes()) != (GROUP_BYTES, GROUP_BYTES_8):
        raise KernelUnavailable(
            f"{path} packs {lib.grp_bytes()} / {lib.grp8_bytes()} bytes per 4- / 8-bit block,"
            f" this module {GROUP_BYTES} / {GROUP_BYTES_8}."
        )
    return Kernel(lib, path)


def _aligned(nbytes: int, align: int = 64) -> npt.NDArray[np.uint8]:
    """A uint8 buffer whose start is aligned to a cache line."""
    buf = np.empty(nbytes + align, np.uint8)
    offset = (-buf.ctypes.data) % align
    return buf[offset : offset + nbytes]


def unpack_matmulnbits(
    b: npt.NDArray[np.uint8], zero_points: npt.NDArray[np.uint8] | None, k: int, n: int
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
    """MatMulNBits' packed 4-bit weights and zero points -> q [N, K] and z [N, K/32], values 0..15.

    ``b``: uint8 [N, K/32, 16], k = 2i in the low nibble of byte i, 2i+1 in the high one.
    ``zero_points``: uint8 [N * ceil(K/32 / 2)], block 2j in the low nibble; None means 8 (symmetric).
    """
    nb = k // BLOCK
    if b.shape != (n, nb, BLOCK // 2) or b.dtype != np.uint8:
        raise ValueError(f"B must be uint8 [N, K/32, 16] = [{n}, {nb}, 16], got {b.dtype} {list(b.shape)}.")
    q = np.empty((n, nb, BLOCK // 2, 2), np.uint8)
    q[..., 0] = b & 0x0F
    q[..., 1] = b >> 4
    if zero_points is None:
        return q.reshape(n, k), np.full((n, nb), 8, np.uint8)
    per_column = (nb + 1) // 2
    if zero_points.size != n * per_column or zero_points.dtype != np.uint8:
        raise ValueError(
            f"zero points must be uint8 [N * ceil(K/32 / 2)] = [{n * per_column}], got {zero_points.size}."
        )
    zp = zero_points.reshape(n, per_column)
    z = np.stack([zp & 0x0F, zp >> 4], axis=2).reshape(n, 2 * per_column)[:, :nb]
    return q.reshape(n, k), np.ascontiguousarray(z)


def unpack_matmulnbits8(
    b: npt.NDArray[np.uint8], zero_points: npt.NDArray[np.uint8] | None, k: int, n: int
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
    """MatMulNBits' 8-bit weights and zero points -> q [N, K] and z [N, K/32], values 0..255.

    ``b``: uint8 [N, K/32, 32], one byte per weight in k order. ``zero_points``: uint8 [N * K/32], one
    byte per block; None means 128 (symmetric).
    """
    nb = k // BLOCK
    if b.shape != (n, nb, BLOCK) or b.dtype != np.uint8:
        raise ValueError(f"B must be uint8 [N, K/32, 32] = [{n}, {nb}, 32], got {b.dtype} {list(b.shape)}.")
    if zero_points is None:
        return b.reshape(n, k), np.full((n, nb), 128, np.uint8)
    if zero_points.size != n * nb or zero_points.dtype != np.uint8:
        raise ValueError(f"8-bit zero points must be uint8 [N * K/32] = [{n * nb}], got {zero_points.size}.")
    return b.reshape(n, k), np.ascontiguousarray(zero_points.reshape(n, nb))


def pack_weights(
    b: npt.NDArray[np.uint8],
    scales: npt.NDArray[np.float32],
    zero_points: npt.NDArray[np.uint8] | None,
    k: int,
    n: int,
    bits: int = 4,
) -> npt.NDArray[np.uint8]:
    """MatMulNBits weights (``bits`` 4 or 8, block_size=32: B, scales, zero points) in the kernel's layout
    (kq4.c): for 4 bits B is [N, K/32, 16], for 8 bits [N, K/32, 32]."""
    if k <= 0 or k % BLOCK or n <= 0 or n % GROUP_COLUMNS:
        raise ValueError(
            f"the kernel needs K a multiple of {BLOCK} and N a multiple of {GROUP_COLUMNS}, got K={k} N={n}."
        )
    if bits not in BITS:
        raise ValueError(f"the kernel takes weights of {BITS} bits, got {bits}.")
    nb, groups = k // BLOCK, n // GROUP_COLUMNS
    if scales.size != n * nb:
        raise ValueError(f"scales must hold N * K/32 = {n * nb} values, got {scales.size}.")
    sw = np.ascontiguousarray(scales.astype(np.float32).reshape(groups, GROUP_COLUMNS, nb).transpose(0, 2, 1))
    if bits == 8:
        q, z = unpack_matmulnbits8(b, zero_points, k, n)
        w = q.reshape(groups, GROUP_COLUMNS, nb, 8, 4)  # [group, column, block, chunk, kk]
        out = _aligned(groups * nb * GROUP_BYTES_8).reshape(groups, nb, GROUP_BYTES_8)
        # byte i of chunk c: column i/4, k = 4c + i%4
        out[..., :256] = w.transpose(0, 2, 3, 1, 4).reshape(groups, nb, 256)
        out[..., 256:288] = sw.view(np.uint8).reshape(groups, nb, 32)
        out[..., 288:296] = z.reshape(groups, GROUP_COLUMNS, nb).transpose(0, 2, 1)
        return out.reshape(-1)
    largest = float(np.abs(sw).max(initial=0.0))
    if not np.all(np.isfinite(sw)) or largest > FP16_MAX:
        raise ValueError(
            f"4-bit scales must be finite and at most {FP16_MAX:g} in magnitude (the kernel stores them as fp16),"
            f" got a largest |scale| of {largest:g}: run this model on onnxruntime's kernels (int4_kernel mlas)."
        )
    q, z = unpack_matmulnbits(b, zero_points, k, n)
    w = q.reshape(groups, GROUP_COLUMNS, nb, BLOCK).transpose(0, 2, 1, 3)  # [group, block, column, k]
    # byte i of chunk c: column i/4, k = 4c + i%4 (low nibble) and 16 + 4c + i%4 (high nibble)
    lo = w[..., :16].reshape(groups, nb, 8, 4, 4).transpose(0, 1, 3, 2, 4).reshape(groups, nb, 128)
    hi = w[..., 16:].reshape(groups, nb, 8, 4, 4).transpose(0, 1, 3, 2, 4).reshape(groups, nb, 128)
    out = _aligned(groups * nb * GROUP_BYTES).reshape(groups, nb, GROUP_BYTES)
    out[..., :128] = lo | (hi << 4)
    out[..., 128:144] = sw.astype(np.float16).view(np.uint8).reshape(groups, nb, 16)  # nearest fp16
    zg = z.reshape(groups, GROUP_COLUMNS, nb).transpose(0, 2, 1)  # [group, block, column]
    out[..., 144:148] = zg[..., 0::2] | (zg[..., 1::2] << 4)  # columns 2j (low nibble) and 2j + 1 (high)
    return out.reshape(-1)


class Int4MatMul:
    """One weight matrix packed for the kernel; calling it with A [M, K] float32 returns A @ W^T [M, N] float32.

    ``bits``: 4 (the default) or 8, the MatMulNBits weights' width (:func:`pack_weights`)."""

    def __init__(
        self,
        kernel: Kernel,
        b: npt.NDArray[np.uint8],
        scales: npt.NDArray[np.float32],
        zero_points: npt.NDArray[np.uint8] | None,
        k: int,
        n: int,
        bits: int = 4,
    ) -> None:
        self.kernel, self.k, self.n, self.bits = kernel, k, n, bits
        self.packed = pack_weights(b, scales, zero_points, k, n, bits)

    def _activations(self, a: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        if a.ndim != 2 or a.shape[1] != self.k or a.shape[0] < 1:
            raise ValueError(f"A must be [M, {self.k}] with M >= 1, got {list(a.shape)}.")
        return np.ascontiguousarray(a, np.float32)

    def workspace(self, m: int) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """Scratch for ``m`` rows: quantized activations, their scales and scale * sum per block."""
        nb = self.k // BLOCK
        return np.empty(m * self.k, np.int8), np.empty(m * nb, np.float32), np.empty(m * nb, np.float32)

    def __call__(self, a: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        a = self._activations(a)
        m = a.shape[0]
        out = np.empty((m, self.n), np.float32)
        qa, sa, sasum = self.workspace(m)
        matmul = self.kernel.lib.matmul_q8 if self.bits == 8 else self.kernel.lib.matmul_q4
        matmul(
            a.ctypes.data, m, self.k, self.packed.ctypes.data, self.n, out.ctypes.data,
            qa.ctypes.data, sa.ctypes.data, sasum.ctypes.data,
        )  # fmt: skip
        return out

    def quantize(
        self, a: npt.NDArray[np.float32]
    ) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """The kernel's activation quantization alone: int8 [M, K], scales and scale * sum [M, K/32]."""
        a = self._activations(a)
        m = a.shape[0]
        qa, sa, sasum = self.workspace(m)
        self.kernel.lib.quantize_rows(a.ctypes.data, m, self.k, qa.ctypes.data, sa.ctypes.data, sasum.ctypes.data)
        nb = self.k // BLOCK
        return qa.reshape(m, self.k), sa.reshape(m, nb), sasum.reshape(m, nb)

    def time_ns(self, a: npt.NDArray[np.float32], reps: int) -> float:
        """ns per call (activation quantization included), over ``reps`` calls in a C loop."""
        a = self._activations(a)
        m = a.shape[0]
        out = np.empty((m, self.n), np.float32)
        qa, sa, sasum = self.workspace(m)
        timer = self.kernel.lib.time_matmul_q8 if self.bits == 8 else self.kernel.lib.time_matmul_q4
        return float(
            timer(
                reps, a.ctypes.data, m, self.k, self.packed.ctypes.data, self.n, out.ctypes.data,
                qa.ctypes.data, sa.ctypes.data, sasum.ctypes.data,
            )
        )  # fmt: skip


if __name__ == "__main__":  # `python -m services.edge_worker.native.kernel`: build it now (the Docker image does)
    try:
        print(compile_kernel())
    except KernelUnavailable as exc:
        raise SystemExit(f"int4 kernel not built: {exc}") from None
