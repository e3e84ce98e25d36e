"""Which prefilling sequences share a model call (services/edge_worker/ort_engine.py, ``prefill_groups``):
first chunks of one length, at most ``max_tokens`` tokens per call, later chunks alone, order kept."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.edge_worker.ort_engine import prefill_groups

CHUNK = 16


@dataclass(eq=False)
class Seq:
    name: str
    prefill_end: int
    kv_len: int = 0


def chunk_end(seq: Any) -> int:
    return int(min(seq.prefill_end, seq.kv_len + CHUNK))


def names(groups: list[list[Any]]) -> list[list[str]]:
    return [[seq.name for seq in group] for group in groups]


def test_first_chunks_of_one_length_share_a_call_up_to_the_token_bound() -> None:
    seqs = [Seq(f"s{i}", prefill_end=5) for i in range(4)]
    assert names(prefill_groups(seqs, chunk_end, CHUNK)) == [["s0", "s1", "s2"], ["s3"]]  # 3 x 5 <= 16 < 4 x 5


def test_different_lengths_and_later_chunks_get_calls_of_their_own() -> None:
    seqs = [
        Seq("a", prefill_end=5),
        Seq("long", prefill_end=40),  # first chunk: 16 tokens
        Seq("b", prefill_end=7),
        Seq("c", prefill_end=5),
        Seq("later", prefill_end=40, kv_len=16),  # past context: one sequence per call
        Seq("long2", prefill_end=90),  # first chunk: 16 tokens, but a call of 16 is full
    ]
    assert names(prefill_groups(seqs, chunk_end, CHUNK)) == [["a", "c"], ["long"], ["b"], ["later"], ["long2"]]


def test_nothing_to_prefill_gives_no_calls() -> None:
    assert prefill_groups([], chunk_end, CHUNK) == []
