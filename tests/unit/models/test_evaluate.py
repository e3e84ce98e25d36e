"""`models eval` metrics on fake models: perplexity, top-1 and greedy agreement, the table, the CLI."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest

from services.models import evaluate as ev

VOCAB = 8


def bigram(shift: int, sharp: float = 5.0) -> ev.Variant:
    """Predicts token (last + shift) % VOCAB with confidence ``sharp``."""

    def logits(ids: list[int]) -> np.ndarray:
        out = np.zeros((len(ids), VOCAB), dtype=np.float32)
        for i, t in enumerate(ids):
            out[i, (t + shift) % VOCAB] = sharp
        return out

    return ev.Variant(logits)


def test_identical_models_agree_fully_and_a_shifted_one_does_not() -> None:
    ids = [i % VOCAB for i in range(300)]  # the text is exactly "next = last + 1"
    results = ev.evaluate(
        {"ref": bigram(1), "same": bigram(1), "other": bigram(2)}, "ref", ids, window=64, greedy_prompts=2
    )
    ref, same, other = results
    expected_ppl = math.exp(-(5.0 - math.log(math.exp(5.0) + VOCAB - 1)))
    assert ref.perplexity == pytest.approx(expected_ppl, rel=1e-4)
    assert same.perplexity == pytest.approx(ref.perplexity) and same.top1_agreement == 1.0
    assert same.greedy32_agreement == 1.0
    assert other.perplexity > ref.perplexity and other.top1_agreement == 0.0
    assert other.greedy32_agreement == 0.125  # +2 and +1 walks meet every 8th step (mod 8)
    table = ev.markdown_table(results, "ref")
    assert "| other |" in table and "+0.0 %" in table


def test_cli_rejects_a_bad_variant_and_an_empty_selection(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    ev.add_arguments(parser)
    assert ev.run(parser.parse_args(["--only", "--variant", "nodir"])) == 2
    assert ev.run(parser.parse_args(["--only"])) == 1
    assert "NAME=DIR" in capsys.readouterr().err


def test_default_variants_lists_what_exists(tmp_path: Path) -> None:
    root = tmp_path / "smollm2-135m-instruct"
    (root / "hf").mkdir(parents=True)
    (root / "student" / "edge-int4").mkdir(parents=True)
    found = ev.default_variants(tmp_path)
    assert list(found) == ["fp32", "student int4"]
    json.dumps({k: str(v) for k, v in found.items()})
