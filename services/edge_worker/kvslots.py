"""KV memory of the batched edge engine: one buffer per layer and K/V whose rows are sequence slots.

Layout ``[slots, kv_heads, capacity, head_size]`` (float32): what the builder's GroupQueryAttention
reads and extends in place when a run binds the same buffer as past and present (onnxruntime's
``past_present_share_buffer``: each row writes its new K/V at its own length, read from the attention
mask). A run over rows ``[first, first + count)`` binds views of those slots, so the sequences of one
decode step must sit in the lowest slots; :meth:`KvSlots.swap` moves a slot's valid tokens.

Capacity (tokens per slot) starts small and doubles up to the model's context when a sequence needs
more, so memory follows the longest live sequence instead of the context length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnxruntime as ort


class KvSlots:
    """``slots`` rows of KV for ``layers`` layers; valid lengths are tracked by the sequences."""

    def __init__(
        self, *, layers: int, kv_heads: int, head_size: int, slots: int, capacity: int, max_capacity: int
    ) -> None:
        self.layers = layers
        self.slots = slots
        self.max_capacity = max_capacity
        self._shape = (kv_heads, head_size)
        self.capacity = min(capacity, max_capacity)
        self.bytes_per_token = 2 * layers * kv_heads * head_size * 4
        self._buffers = [self._zeros(self.capacity) for _ in range(2 * layers)]
        self._bindings: dict[tuple[int, int, int], tuple[ort.IOBinding, list[np.ndarray]]] = {}

    def _zeros(self, capacity: int) -> np.ndarray:
        kv_heads, head_size = self._shape
        return np.zeros((self.slots, kv_heads, capacity, head_size), dtype=np.float32)

    @property
    def allocated_bytes(self) -> int:
        return self.slots * self.capacity * self.bytes_per_token

    def ensure_capacity(self, tokens: int, lengths: Sequence[int] | None = None) -> None:
        """Grow every slot to hold ``tokens`` (doubling). Raises past the context.

        ``lengths``: valid tokens per slot; only those are copied, so the new buffers' pages stay
        unallocated beyond them (None copies everything).
        """
        if tokens <= self.capacity:
            return
        if tokens > self.max_capacity:
            raise ValueError(f"a sequence needs {tokens} tokens of KV but the model context is {self.max_capacity}")
        capacity = self.capacity
        while capacity < tokens:
            capacity *= 2
        capacity = min(capacity, self.max_capacity)
        grown = []
        for old in self._buffers:
            new = self._zeros(capacity)
            if lengths is None:
                new[:, :, : self.capacity] = old
            else:
                for slot, valid in enumerate(lengths):
                    new[slot, :, :valid] = old[slot, :, :valid]
            grown.append(new)
        self._buffers = grown
        self.capacity = capacity
        self._bindings.clear()

    def swap(self, a: int, b: int, tokens: int) -> None:
        """Exchange the first ``tokens`` positions of slots ``a`` and ``b``."""
        if a == b or tokens <= 0:
            return
        for buf in self._buffers:
            keep = buf[a, :, :tokens].copy()
            buf[a, :, :tokens] = buf[b, :, :tokens]
            buf[b, :, :tokens] = keep

    def copy(self, src: int, dst: int, tokens: int) -> None:
        """Copy the first ``tokens`` positions of slot ``src`` into slot ``dst`` (a forked sequence: the
        n choices of one prompt; slots are contiguous rows, so a prefix cannot be shared in place)."""
        if src == dst or tokens <= 0:
            return
        for buf in self._buffers:
            buf[dst, :, :tokens] = buf[src, :, :tokens]

    def copy_out(self, slot: int, tokens: int) -> list[np.ndarray]:
        """A compact copy of a slot's first ``tokens`` positions (a parked sequence keeps it)."""
        return [buf[slot, :, :tokens].copy() for buf in self._buffers]

    def copy_in(self, slot: int, saved: list[np.ndarray]) -> None:
        """Restore a parked slot (the caller made room: ``ensure_capacity`` first)."""
        tokens = saved[0].shape[1] if saved else 0
        for buf, part in zip(self._buffers, saved, strict=True):
            buf[slot, :, :tokens] = part

    def binding(self, session: ort.InferenceSession, first: int, count: int) -> ort.IOBinding:
        """An IOBinding with logits as output 0 and slots ``[first, first + count)`` as past and present.

        Cached per session and row range until the capacity changes; callers bind ``input_ids`` and
        ``attention_mask`` before each run.
        """
        key = (id(session), first, count)
        cached = self._bindings.get(key)
        if cached is not None:
            return cached[0]
        io = session.io_binding()
        io.bind_output("logits")
        views: list[Any] = []
        for layer in range(self.layers):
            for kind, buf in (("key", self._buffers[2 * layer]), ("value", self._buffers[2 * layer + 1])):
                view = buf[first : first + count]
                value = ort.OrtValue.ortvalue_from_numpy(view)
                io.bind_ortvalue_input(f"past_key_values.{layer}.{kind}", value)
                io.bind_ortvalue_output(f"present.{layer}.{kind}", value)
                views += [view, value]
        self._bindings[key] = (io, views)
        return io
