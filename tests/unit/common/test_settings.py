"""Typed settings: env over YAML over defaults, and errors that name the variable."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic_settings import SettingsConfigDict

from services.common.errors import ConfigError
from services.common.settings import ServiceSettings, load_settings


class DemoSettings(ServiceSettings):
    service = "demo"
    model_config = SettingsConfigDict(env_prefix="MESHSERVE_DEMO_", extra="ignore")

    threads: int = 1
    """Threads."""


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESHSERVE_CONFIG", raising=False)
    settings = load_settings(DemoSettings)
    assert (settings.host, settings.port, settings.threads) == ("127.0.0.1", 0, 1)


def test_env_wins_over_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "meshserve.yaml"
    config.write_text("demo:\n  threads: 3\n  port: 7000\nother:\n  port: 1\n")
    monkeypatch.setenv("MESHSERVE_CONFIG", str(config))
    monkeypatch.setenv("MESHSERVE_DEMO_THREADS", "5")
    settings = load_settings(DemoSettings)
    assert (settings.threads, settings.port) == (5, 7000)


def test_invalid_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSERVE_DEMO_PORT", "seventy")
    with pytest.raises(ConfigError, match="MESHSERVE_DEMO_PORT"):
        load_settings(DemoSettings)


def test_unreadable_yaml_says_how_to_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSERVE_CONFIG", str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="MESHSERVE_CONFIG"):
        load_settings(DemoSettings)
