"""Index tensors of one packed model step: where each new token's K/V goes and what it attends to.

Built from :class:`Segment` s (one per sequence) by :meth:`StepPlan.build`; consumed by
``LlamaModel.forward``. Decode segments (one token) are batched into one attention call over a
padded gather of their KV slots; longer segments (prefill chunks, verify runs) run one attention
call each with a causal mask that keeps the cached prefix visible.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Segment:
    """One sequence's new tokens in a step (see the module docstring)."""

    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int]
    all_logits: bool = False


@dataclass
class StepPlan:
    """Index tensors of one step: where each token goes in the cache and what it attends to."""

    tokens: Tensor
    positions: Tensor
    slots: Tensor
    decode_rows: Tensor | None
    decode_index: Tensor | None
    decode_mask: Tensor | None
    extends: list[tuple[int, int, Tensor, Tensor]]
    logit_rows: Tensor
    logit_counts: list[int]

    @classmethod
    def build(cls, segments: Sequence[Segment], block: int, group: int, device: torch.device) -> StepPlan:
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode: list[tuple[int, list[int]]] = []
        extends: list[tuple[int, int, list[int]]] = []
        logit_rows: list[int] = []
        logit_counts: list[int] = []
        for seg in segments:
            count = len(seg.token_ids)
            if count == 0:
                raise ValueError("a segment needs at least one token")
            end = seg.start + count
            if (end + block - 1) // block > len(seg.block_table):
                raise ValueError(f"block table too short for {end} tokens")
            table = seg.block_table
            seq_slots = [table[p // block] * block + p % block for p in range(end)]
            row = len(tokens)
            tokens.extend(seg.token_ids)
            positions.extend(range(seg.start, end))
            slots.extend(seq_slots[seg.start :])
            if count == 1:
                decode.append((row, seq_slots))
            else:
                extends.append((row, count, seq_slots))
            if seg.all_logits:
                logit_rows.extend(range(row, row + count))
                logit_counts.append(count)
            else:
                logit_rows.append(row + count - 1)
                logit_counts.append(1)

        def t(values: list[int]) -> Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        decode_rows = decode_index = decode_mask = None
        if decode:
            longest = max(len(s) for _, s in decode)
            decode_rows = t([r for r, _ in decode])
            decode_index = t([i for _, s in decode for i in s + [0] * (longest - len(s))]).view(len(decode), longest)
            lengths = t([len(s) for _, s in decode])
            decode_mask = torch.arange(longest, device=device)[None, :] < lengths[:, None]
            decode_mask = decode_mask.view(len(decode), 1, 1, longest)
        ext: list[tuple[int, int, Tensor, Tensor]] = []
        for row, count, seq_slots in extends:
            total = len(seq_slots)
            cols = torch.arange(total, device=device)[None, :]
            rows = torch.arange(total - count, total, device=device)[:, None]
            # Causal over the new tokens with the cached prefix visible; repeated for the ``group``
            # query heads that share a KV head (they are folded into the query axis, head-major).
            mask = (cols <= rows).repeat(group, 1)
            ext.append((row, count, t(seq_slots), mask))
        return cls(
            t(tokens), t(positions), t(slots), decode_rows, decode_index, decode_mask, ext, t(logit_rows), logit_counts
        )
