"""Teacher-text corpus: the built-in prompt list, option parsing and checks, held-out overlap, reuse rules."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from services.models import distill as dist
from services.models import teacher_text as tt
from services.models.evaluate import HELDOUT


def test_prompts_are_deterministic_varied_and_cycle() -> None:
    first = tt.prompts(500)
    assert first == tt.prompts(500) and first != tt.prompts(500, seed=1)
    assert len(set(first)) == 500  # no repeats before the list of topic x task pairs runs out
    everything = len(tt.TOPICS) * len(tt.TASKS)
    many = tt.prompts(everything + 7)
    assert len(set(many)) == everything and many[everything:] == many[:7]
    assert all("{t}" not in p and p.strip() for p in many)


def test_no_prompt_quotes_the_held_out_text() -> None:
    shingles = tt.heldout_shingles([HELDOUT.read_text()], words=6)
    assert shingles
    assert not any(tt.overlaps(p, shingles, words=6) for p in tt.prompts(len(tt.TOPICS) * len(tt.TASKS)))
    assert not any("tempest" in p.lower() for p in tt.prompts(len(tt.TOPICS) * len(tt.TASKS)))


def test_overlap_detects_a_quoted_run_of_words() -> None:
    heldout = HELDOUT.read_text().split()
    quoted = " ".join(heldout[100 : 100 + tt.OVERLAP_WORDS])
    shingles = tt.heldout_shingles([HELDOUT.read_text()])
    assert tt.overlaps(f"The assistant said: {quoted.upper()}!", shingles)
    assert not tt.overlaps("Photosynthesis turns light, water and carbon dioxide into sugar.", shingles)


def test_distill_cli_parses_the_teacher_text_options() -> None:
    parser = argparse.ArgumentParser()
    dist.add_arguments(parser)
    off = tt.from_args(parser.parse_args([]))
    assert off.samples == 0  # off by default
    on = tt.from_args(
        parser.parse_args(["--teacher-text", "12", "--teacher-text-tokens", "64", "--teacher-text-temperature", "0.7"])
    )
    assert (on.samples, on.max_new_tokens, on.temperature, on.top_p) == (12, 64, 0.7, 0.95)


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("samples", -1, "--teacher-text"),
        ("max_new_tokens", 0, "--teacher-text-tokens"),
        ("temperature", 0.0, "--teacher-text-temperature"),
        ("top_p", 1.5, "--teacher-text-top-p"),
        ("batch_size", 0, "--teacher-text-batch"),
    ],
)
def test_bad_options_are_one_clear_error(field: str, value: float, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        tt.TeacherTextOptions(**{field: value})  # type: ignore[arg-type]


def _write(out: Path, opts: tt.TeacherTextOptions, teacher: Path, texts: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"prompt": "p", "text": t, "new_tokens": 1}) for t in texts]
    (out / tt.CORPUS_FILE).write_text("\n".join(lines) + "\n")
    (out / tt.META_FILE).write_text(json.dumps({"settings": opts.settings(teacher), "samples": len(texts)}))


def test_a_matching_file_is_reused_without_the_model(tmp_path: Path) -> None:
    opts = tt.TeacherTextOptions(samples=2, batch_size=8)
    _write(tmp_path, opts, tmp_path / "teacher", ["one", "two"])
    again = tt.TeacherTextOptions(samples=2, batch_size=1)  # the batch size does not change the text
    assert tt.ensure(tmp_path, tmp_path / "teacher", None, None, again, False) == ["one", "two"]
    assert tt.ensure(tmp_path, tmp_path / "teacher", None, None, tt.TeacherTextOptions(), False) == []


def test_a_file_made_with_other_settings_is_an_error(tmp_path: Path) -> None:
    _write(tmp_path, tt.TeacherTextOptions(samples=2), tmp_path / "teacher", ["one", "two"])
    with pytest.raises(ValueError, match=r"samples, temperature differ.*delete it"):
        tt.ensure(tmp_path, tmp_path / "teacher", None, None, tt.TeacherTextOptions(samples=3, temperature=0.5), False)
    with pytest.raises(ValueError, match="teacher differ"):
        tt.ensure(tmp_path, tmp_path / "other", None, None, tt.TeacherTextOptions(samples=2), False)
