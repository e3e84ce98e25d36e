"""The `draft-int8/` step of `models prepare` with fake builders: built, skipped, rebuilt, --no-draft."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.common.model_paths import DEFAULT_MODEL_ID, model_paths
from services.models import draft
from services.models import prepare as prep
from services.models.quantize import Int4Options
from services.models.sources import Source
from tests.unit.models.test_prepare import SOURCE, write_edge, write_hf


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fake hf/edge/draft builders recording what was built; the source is always SOURCE."""
    done: list[str] = []

    def fake_hf(source: Source, dest: Path, show_progress: bool = True) -> None:
        done.append("hf")
        write_hf(dest, value=float(len(done)))

    def fake_edge(hf: Path, dest: Path, log: Path, show_progress: bool = True, int4: Int4Options | None = None) -> None:
        done.append("edge")
        write_edge(dest)

    def fake_draft(hf: Path, dest: Path, log: Path, show_progress: bool = True) -> None:
        assert prep.hf_complete(hf)
        done.append("draft")
        write_edge(dest)

    monkeypatch.setattr(prep, "build_hf", fake_hf)
    monkeypatch.setattr(prep, "build_edge", fake_edge)
    monkeypatch.setattr(draft, "build_draft", fake_draft)
    monkeypatch.setattr(prep, "resolve_source", lambda _: SOURCE)
    return done


def cli(tmp_path: Path, *extra: str) -> int:
    from services.cli import main

    return main(["models", "prepare", "--models-dir", str(tmp_path), "--model-id", DEFAULT_MODEL_ID, "--quiet", *extra])


def test_prepare_builds_the_draft_once(tmp_path: Path, builds: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(tmp_path) == 0
    assert builds == ["hf", "edge", "draft"] and "built hf, edge, manifest, draft" in capsys.readouterr().out
    paths = model_paths(DEFAULT_MODEL_ID, tmp_path)
    assert draft.draft_complete(paths) and not list(paths.root.glob(".*.partial"))
    assert cli(tmp_path) == 0
    assert builds == ["hf", "edge", "draft"] and "already prepared" in capsys.readouterr().out


def test_no_draft_skips_it_and_a_later_run_adds_it(tmp_path: Path, builds: list[str]) -> None:
    assert cli(tmp_path, "--no-draft") == 0
    assert builds == ["hf", "edge"] and not model_paths(DEFAULT_MODEL_ID, tmp_path).draft_dir.exists()
    assert cli(tmp_path) == 0
    assert builds == ["hf", "edge", "draft"], "only the missing draft is built"


def test_incomplete_or_stale_draft_is_rebuilt(tmp_path: Path, builds: list[str]) -> None:
    assert cli(tmp_path) == 0
    paths = model_paths(DEFAULT_MODEL_ID, tmp_path)
    (paths.draft_dir / "model.onnx").unlink()
    assert cli(tmp_path) == 0
    assert builds == ["hf", "edge", "draft", "draft"]
    draft_config = paths.draft_dir / "genai_config.json"  # older than hf/ (e.g. hf rebuilt with --no-draft)
    earlier = (paths.hf_dir / "config.json").stat().st_mtime - 10
    os.utime(draft_config, (earlier, earlier))
    assert not draft.draft_complete(paths)
    assert cli(tmp_path) == 0
    assert builds[-1] == "draft" and draft.draft_complete(paths)


def test_rebuilt_hf_rebuilds_the_draft(tmp_path: Path, builds: list[str]) -> None:
    assert cli(tmp_path) == 0
    assert cli(tmp_path, "--force") == 0
    assert builds == ["hf", "edge", "draft"] * 2


def test_complete_hand_built_draft_is_adopted(tmp_path: Path, builds: list[str]) -> None:
    assert cli(tmp_path, "--no-draft") == 0
    paths = model_paths(DEFAULT_MODEL_ID, tmp_path)
    write_edge(paths.draft_dir)  # built by hand after hf/
    assert draft.prepare_draft(paths, show_progress=False) is False and builds == ["hf", "edge"]


def test_draft_needs_the_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(prep.PrepareError, match="no HF checkpoint"):
        draft.prepare_draft(model_paths(DEFAULT_MODEL_ID, tmp_path), show_progress=False)
