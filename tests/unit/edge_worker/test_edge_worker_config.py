from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import load_settings
from services.common.errors import ConfigError
from services.edge_worker import server as startup
from services.edge_worker.config import EdgeWorkerSettings
from services.edge_worker.native import kernel as native_kernel
from services.edge_worker.server import build_engine


def test_env_vars_and_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MESHSERVE_EDGE_WORKER_MAX_ACTIVE_SEQUENCES", "3")
    monkeypatch.setenv("MESHSERVE_EDGE_WORKER_MODEL_DIR", str(tmp_path))
    settings = load_settings(EdgeWorkerSettings)
    assert (settings.max_active_sequences, settings.model_id, settings.warmup) == (3, "smollm2-135m-instruct", True)
    assert settings.resolved_model_dir() == tmp_path
    assert settings.resolved_worker_id(5000) == "127.0.0.1:5000"
    assert load_settings(EdgeWorkerSettings, worker_id="edge-0").resolved_worker_id(5000) == "edge-0"


def test_invalid_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSERVE_EDGE_WORKER_MAX_ACTIVE_SEQUENCES", "0")
    with pytest.raises(ConfigError, match="MESHSERVE_EDGE_WORKER_MAX_ACTIVE_SEQUENCES"):
        load_settings(EdgeWorkerSettings)


def test_missing_model_says_how_to_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="meshserve models prepare"):
        load_settings(EdgeWorkerSettings, model_dir=tmp_path).check_model()


def test_engine_choice_and_batching_options(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = load_settings(EdgeWorkerSettings)
    assert (defaults.engine, defaults.batch_invariant) == ("batched", True)
    monkeypatch.setenv("MESHSERVE_EDGE_WORKER_ENGINE", "og")
    monkeypatch.setenv("MESHSERVE_EDGE_WORKER_BATCH_INVARIANT", "false")
    settings = load_settings(EdgeWorkerSettings)
    assert (settings.engine, settings.batch_invariant) == ("og", False)
    monkeypatch.setenv("MESHSERVE_EDGE_WORKER_ENGINE", "vllm")
    with pytest.raises(ConfigError, match="MESHSERVE_EDGE_WORKER_ENGINE"):
        load_settings(EdgeWorkerSettings)


def test_lm_head_and_spinning_options(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = load_settings(EdgeWorkerSettings)
    assert (defaults.lm_head, defaults.intra_op_spinning, defaults.intra_op_spin_us) == ("int8", True, 200)
    monkeypatch.setenv("MESHSERVE_EDGE_WORKER_LM_HEAD", "nbits")
    monkeypatch.setenv("MESHSERVE_EDGE_WORKER_INTRA_OP_SPINNING", "false")
    monkeypatch.setenv("MESHSERVE_EDGE_WORKER_INTRA_OP_SPIN_US", "0")
    settings = load_settings(EdgeWorkerSettings)
    assert (settings.lm_head, settings.intra_op_spinning, settings.intra_op_spin_us) == ("nbits", False, 0)
    monkeypatch.setenv("MESHSERVE_EDGE_WORKER_INTRA_OP_SPIN_US", "-1")
    with pytest.raises(ConfigError, match="MESHSERVE_EDGE_WORKER_INTRA_OP_SPIN_US"):
        load_settings(EdgeWorkerSettings)
    monkeypatch.delenv("MESHSERVE_EDGE_WORKER_INTRA_OP_SPIN_US")
    assert (defaults.adaptive_threading, defaults.adaptive_max_rows) == (False, 4)
    monkeypatch.setenv("MESHSERVE_EDGE_WORKER_ADAPTIVE_THREADING", "true")
    monkeypatch.setenv("MESHSERVE_EDGE_WORKER_ADAPTIVE_MAX_ROWS", "2")
    settings = load_settings(EdgeWorkerSettings)
    assert (settings.adaptive_threading, settings.adaptive_max_rows) == (True, 2)
    monkeypatch.setenv("MESHSERVE_EDGE_WORKER_ADAPTIVE_MAX_ROWS", "0")
    with pytest.raises(ConfigError, match="MESHSERVE_EDGE_WORKER_ADAPTIVE_MAX_ROWS"):
        load_settings(EdgeWorkerSettings)
    monkeypatch.setenv("MESHSERVE_EDGE_WORKER_ADAPTIVE_MAX_ROWS", "4")
    monkeypatch.setenv("MESHSERVE_EDGE_WORKER_LM_HEAD", "fp8")
    with pytest.raises(ConfigError, match="MESHSERVE_EDGE_WORKER_LM_HEAD"):
        load_settings(EdgeWorkerSettings)


def test_int4_kernel_auto_is_native_where_it_builds_else_mlas(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = load_settings(EdgeWorkerSettings)
    assert settings.int4_kernel == "auto"
    built: list[bool] = []
    monkeypatch.setattr(startup, "compile_kernel", lambda: built.append(True) or tmp_path / "kq4.so")
    assert startup.int4_kernel(settings) == "native"
    assert built == [True]
    monkeypatch.setenv("MESHSERVE_EDGE_WORKER_ADAPTIVE_THREADING", "true")  # auto yields to adaptive threading
    assert startup.int4_kernel(load_settings(EdgeWorkerSettings)) == "mlas"
    monkeypatch.delenv("MESHSERVE_EDGE_WORKER_ADAPTIVE_THREADING")
    monkeypatch.setenv("MESHSERVE_EDGE_WORKER_INT4_KERNEL", "mlas")
    assert startup.int4_kernel(load_settings(EdgeWorkerSettings)) == "mlas"
    assert built == [True]  # mlas asked for: nothing compiled

    def cannot() -> Path:
        raise native_kernel.KernelUnavailable("the int4 kernel needs AVX2 and FMA, and this CPU lacks avx2.")

    monkeypatch.setattr(startup, "compile_kernel", cannot)
    monkeypatch.setenv("MESHSERVE_EDGE_WORKER_INT4_KERNEL", "auto")
    assert startup.int4_kernel(load_settings(EdgeWorkerSettings)) == "mlas"  # falls back, and says why
    captured = capsys.readouterr()
    assert "edge_int4_kernel_fallback" in captured.out + captured.err


def test_int4_kernel_native_without_gcc_is_a_config_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(native_kernel, "default_cache_dir", lambda: tmp_path)  # nothing built there yet
    monkeypatch.setenv("MESHSERVE_EDGE_WORKER_INT4_KERNEL", "native")
    settings = load_settings(EdgeWorkerSettings)
    assert settings.int4_kernel == "native"
    monkeypatch.setattr(native_kernel.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(native_kernel, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.setattr(native_kernel.shutil, "which", lambda _name: None)
    with pytest.raises(
        ConfigError,
        match=r"^MESHSERVE_EDGE_WORKER_INT4_KERNEL=native cannot run on this machine: "
        r"the int4 kernel is compiled with gcc, which is not on PATH",
    ):
        build_engine(settings)
    monkeypatch.setenv("MESHSERVE_EDGE_WORKER_ADAPTIVE_THREADING", "true")
    with pytest.raises(ConfigError, match="cannot be combined with ADAPTIVE_THREADING=true"):
        load_settings(EdgeWorkerSettings)
    monkeypatch.delenv("MESHSERVE_EDGE_WORKER_ADAPTIVE_THREADING")
    monkeypatch.setenv("MESHSERVE_EDGE_WORKER_INT4_KERNEL", "fast")
    with pytest.raises(ConfigError, match="MESHSERVE_EDGE_WORKER_INT4_KERNEL"):
        load_settings(EdgeWorkerSettings)
