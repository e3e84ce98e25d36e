"""benchmarks/edge/cores.py's kernel mode on the real INT4 model: it times the decode calls it says it does."""

from __future__ import annotations

import pytest

from benchmarks.edge.cores import kernel_table
from services.common.model_paths import model_paths

pytestmark = pytest.mark.integration


def test_kernel_table_times_two_row_decode_calls_from_a_100_token_past() -> None:
    table = kernel_table(model_paths().edge_dir, [1, 2, 3, 4, 5, 6, 7], cases=(("batched", 1),), tokens=3, repeats=2)
    assert set(table) == {2}  # a lone sequence decodes as two rows (batch invariance)
    two = table[2]
    assert two["calls"] == 2 * (3 - 1)  # per round: the first token comes from the prefill call
    assert (two["past_min"], two["past_max"]) == (100, 101)
    assert two["cpu_ms"] > 0
