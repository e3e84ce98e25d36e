"""The A/B launcher runs another source tree's services by module name, with that tree alone on the path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks.gateway.tree_mesh import check_tree, command, tree_env, worker_module


def test_another_tree_runs_by_module_name_with_this_tree_off_the_path(tmp_path: Path) -> None:
    assert command("services.router", None) == [sys.executable, "-m", "services.router"]
    assert command("services.router", tmp_path) == [sys.executable, "-P", "-m", "services.router"]
    env = {"PYTHONPATH": "/here", "MESHSERVE_X": "1"}
    assert tree_env(env, None) is env
    assert tree_env(env, tmp_path) == {"PYTHONPATH": str(tmp_path), "MESHSERVE_X": "1"}


def test_the_worker_module_is_found_wherever_the_tree_keeps_it(tmp_path: Path) -> None:
    assert worker_module(tmp_path) is None
    nested = tmp_path / "benchmarks" / "area"
    nested.mkdir(parents=True)
    (nested / "instant_worker.py").write_text("")
    assert worker_module(tmp_path) == "benchmarks.area.instant_worker"


def test_a_folder_that_is_not_a_meshserve_tree_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="has no services/gateway; give the root of a meshserve checkout"):
        check_tree(tmp_path, "hops --ab-tree")
    (tmp_path / "services" / "gateway").mkdir(parents=True)
    assert check_tree(tmp_path / "services" / "..", "hops --ab-tree") == tmp_path.resolve()
