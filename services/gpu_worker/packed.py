"""Linear layers with a oneDNN-prepacked weight for multi-row steps on CPU.

Why: on CPU, ``F.linear`` (MKL sgemm) over a few rows costs about one pass over the weights *per
row*: a speculative verify pass of 5 tokens, or a batch step of a few sequences, cost 2-2.5 single
token steps for SmolLM2-135M (docs/benchmarks/cloud_spec.md), because small-M sgemm repacks and
re-reads the weight on every call. oneDNN with the weight reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, the kernel ``torch.compile``'s CPU freezing pass
uses) runs those steps close to the memory-bound cost of reading the weight once. For a single row
(a decode step of one sequence) MKL's gemv stays as fast or faster, so :class:`Linear` keeps the
plain weight for that case: the price is a second copy of the weights in memory (fp32 on CPU only).
The LM head, whose packed form is faster for every row count, has no second copy beyond the
embedding it is tied to.

Results match ``F.linear`` to float32 rounding (a different summation order).
"""

from __future__ import annotations

import os
import threading

import torch
import torch.nn.functional as F
from torch import Tensor


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacking is available and used for this device and dtype (CPU float32)."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def limit_primitive_cache(entries: int) -> None:
    """Bound oneDNN's primitive cache to ``entries`` kernels (LRU) through its environment variable
    ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``. oneDNN reads it once, when it builds its first primitive, so
    this is process-wide and must run before the process's first oneDNN call (the engine's start)."""
    os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(entries)


def _pack(weight: Tensor, rows_hint: int) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)


def _packed_linear(x: Tensor, packed: Tensor) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


class Packer:
    """Prepacks :class:`Linear` weights on a background thread, so a model serves before they are done.

    Why: reordering the weights of SmolLM2-135M takes ~1 s of CPU (more on a loaded machine), a fifth of
    a cloud worker's start (docs/cloud.md, *Startup*). A call that needs a packed weight not made yet
    waits for the packer (:meth:`wait`) rather than computing with the plain one, so results never
    depend on how far the packing has got. Single-row calls (decode of one sequence) use the plain
    weight anyway and never wait.
    """

    def __init__(self) -> None:
        self._pending: list[Linear] = []
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, linear: Linear) -> None:
        if self._thread is not None:
            raise RuntimeError("the packer has started")
        self._pending.append(linear)

    def start(self) -> None:
        """Pack what was added, in order, on a daemon thread (put the layers needed first first)."""
        self._thread = threading.Thread(target=self._run, name="prepack", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for linear in self._pending:
                linear.packed = _pack(linear.weight, Linear.ROWS_HINT)
        finally:  # a failure leaves the rest unpacked (the plain weight), never a caller waiting forever
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()


class Linear:
    """``y = x @ weight.T``; rows > 1 (or every row, with ``single_row_packed``) use the packed weight.

    ``packer``: pack the weight there (in the background) instead of now; a call that needs the packed
    weight before it is made waits for the packer.
    """

    ROWS_HINT = 8
    """oneDNN picks its blocking for about this many rows: verify passes and small batches."""

    def __init__(
        self, weight: Tensor, *, prepack: bool, single_row_packed: bool = False, packer: Packer | None = None
    ) -> None:
        self.weight = weight
        self.packed: Tensor | None = None
        self._packer = packer if prepack else None
        if prepack and packer is None:
            self.packed = _pack(weight, self.ROWS_HINT)
        elif packer is not None and prepack:
            packer.add(self)
        self._min_rows = 1 if single_row_packed else 2

    def __call__(self, x: Tensor) -> Tensor:
        if x.shape[0] >= self._min_rows:
            if self.packed is None and self._packer is not None:
                self._packer.wait()
            if self.packed is not None:
                return _packed_linear(x, self.packed)
        return F.linear(x, self.weight)
