"""The workers' default load-cache directory is the user's cache, never the models directory's parent.

In the image the models directory is ``/models`` (read-only to the uid-10001 user), so "beside the
models" was ``/load-cache``, which that user cannot write (issue 38): every start rebuilt the edge
graph and the cloud fused weights the cache exists to keep.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import default_load_cache_dir, load_settings
from services.edge_worker.config import EdgeWorkerSettings
from services.gpu_worker.config import GpuWorkerSettings


@pytest.fixture
def container_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The image's environment: models in /models, the meshserve user's home."""
    monkeypatch.setenv("MESHSERVE_MODELS_DIR", "/models")
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_the_default_is_under_the_users_cache_whatever_the_models_directory(container_env: Path) -> None:
    assert default_load_cache_dir("edge") == container_env / ".cache" / "meshserve" / "load-cache" / "edge"
    edge = load_settings(EdgeWorkerSettings).resolved_load_cache_dir()
    cloud = load_settings(GpuWorkerSettings).resolved_load_cache_dir()
    assert edge == container_env / ".cache" / "meshserve" / "load-cache" / "edge"
    assert cloud == container_env / ".cache" / "meshserve" / "load-cache" / "cloud"


def test_a_setting_still_wins_and_off_means_none(container_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSERVE_EDGE_WORKER_LOAD_CACHE_DIR", "/var/cache/edge")
    monkeypatch.setenv("MESHSERVE_GPU_WORKER_LOAD_CACHE", "false")
    assert load_settings(EdgeWorkerSettings).resolved_load_cache_dir() == Path("/var/cache/edge")
    assert load_settings(GpuWorkerSettings).resolved_load_cache_dir() is None
