from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import load_settings
from services.common.errors import ConfigError
from services.gpu_worker.config import GpuWorkerSettings


def test_env_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSERVE_GPU_WORKER_DEVICE", "cpu")
    monkeypatch.setenv("MESHSERVE_GPU_WORKER_MODEL", "some/hub-id")
    settings = load_settings(GpuWorkerSettings)
    assert (settings.device, settings.dtype, settings.check_model()) == ("cpu", "auto", "some/hub-id")


def test_the_cpu_primitive_cache_is_bounded_by_default_and_set_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings(GpuWorkerSettings).cpu_primitive_cache == 128
    monkeypatch.setenv("MESHSERVE_GPU_WORKER_CPU_PRIMITIVE_CACHE", "0")
    assert load_settings(GpuWorkerSettings).cpu_primitive_cache == 0
    monkeypatch.setenv("MESHSERVE_GPU_WORKER_CPU_PRIMITIVE_CACHE", "-1")
    with pytest.raises(ConfigError, match="MESHSERVE_GPU_WORKER_CPU_PRIMITIVE_CACHE"):
        load_settings(GpuWorkerSettings)


def test_bad_device_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSERVE_GPU_WORKER_DEVICE", "tpu")
    with pytest.raises(ConfigError, match="MESHSERVE_GPU_WORKER_DEVICE"):
        load_settings(GpuWorkerSettings)
    with pytest.raises(ConfigError, match="float16"):
        load_settings(GpuWorkerSettings, device="cpu", dtype="float16")


def test_missing_checkpoint_says_how_to_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MESHSERVE_MODELS_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match="meshserve models prepare"):
        load_settings(GpuWorkerSettings).check_model()


def test_default_draft_is_int8_then_edge_int4(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from services.common.model_paths import model_paths

    monkeypatch.setenv("MESHSERVE_MODELS_DIR", str(tmp_path))
    settings = load_settings(GpuWorkerSettings)
    paths = model_paths(settings.model_id, tmp_path)
    with pytest.raises(ConfigError, match="meshserve models prepare"):
        settings.resolved_draft_model()
    for built in (paths.edge_dir, paths.draft_dir):
        built.mkdir(parents=True)
        (built / "genai_config.json").write_text("{}")
        assert settings.resolved_draft_model() == str(built), "draft-int8 wins once it exists"
    other = tmp_path / "mine"
    other.mkdir()
    (other / "genai_config.json").write_text("{}")
    assert load_settings(GpuWorkerSettings, draft_model=str(other)).resolved_draft_model() == str(other)
