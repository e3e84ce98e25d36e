"""A token frame and its merge rule, shared by the coalescing tests (test_coalesce, test_flush_window)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Frame:
    ids: list[int]
    text: str
    final: bool = False


def merge(first: Frame, then: Frame) -> Frame | None:
    """Two token frames as one; a final frame stays a frame of its own."""
    if first.final or then.final:
        return None
    return Frame(first.ids + then.ids, first.text + then.text)
