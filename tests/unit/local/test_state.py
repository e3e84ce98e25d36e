"""services/local/state.py: the state file `meshserve up` writes and the CLI commands read their defaults from."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from services.local.state import read_state, recorded, state_path, write_state


@pytest.fixture
def state_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "sub" / "mesh.json"
    monkeypatch.setenv("MESHSERVE_STATE_FILE", str(path))
    return path


def test_no_mesh_up_reads_as_nothing_recorded(state_file: Path) -> None:
    assert state_path() == state_file
    assert read_state() == {} and recorded("redis") == ""


def test_what_up_wrote_is_read_back_by_name(state_file: Path) -> None:
    write_state({"cache": "127.0.0.1:7100", "redis": "redis://127.0.0.1:7200/0", "metrics": {"gateway": "u"}})
    assert recorded("cache") == "127.0.0.1:7100" and recorded("redis") == "redis://127.0.0.1:7200/0"
    assert recorded("metrics") == "" and recorded("router") == ""  # not an address / not recorded


def test_the_file_is_readable_by_its_owner_only_even_when_it_existed(state_file: Path) -> None:
    state_file.parent.mkdir(parents=True)
    state_file.write_text("{}")
    state_file.chmod(0o644)
    write_state({"redis": "redis://:secret@127.0.0.1:6379/0"})
    assert stat.S_IMODE(state_file.stat().st_mode) == 0o600
    assert [p.name for p in state_file.parent.iterdir()] == ["mesh.json"]  # no temporary file left


@pytest.mark.parametrize("content", ["", "not json", "[1, 2]"])
def test_an_unreadable_file_reads_as_nothing_recorded(state_file: Path, content: str) -> None:
    state_file.parent.mkdir(parents=True)
    state_file.write_text(content)
    assert read_state() == {} and recorded("cache") == ""
