"""Typed settings: env over YAML over defaults, and errors that name the variable."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import model_validator
from pydantic_settings import SettingsConfigDict

from services.common.config import DEFAULT_INTERNAL_TOKEN, ClientSettings, ServiceSettings, load_settings
from services.common.errors import ConfigError


class DemoSettings(ServiceSettings):
    service = "demo"
    model_config = SettingsConfigDict(env_prefix="MESHSERVE_DEMO_", extra="ignore")

    threads: int = 1
    """Threads."""
    peers: int = 0
    """Peers (at most ``threads``)."""
    needed: str = "x"
    """A setting some tests make required."""

    @model_validator(mode="after")
    def _check(self) -> DemoSettings:
        if self.peers > self.threads:
            raise ValueError("peers must not exceed threads; lower MESHSERVE_DEMO_PEERS")
        return self


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


def test_errors_never_print_the_internal_token(monkeypatch: pytest.MonkeyPatch) -> None:
    class Required(DemoSettings):
        needed: str

    monkeypatch.setenv("MESHSERVE_DEMO_INTERNAL_TOKEN", "s3cret-token")
    monkeypatch.setenv("MESHSERVE_DEMO_PEERS", "4")
    with pytest.raises(ConfigError) as missing:
        load_settings(Required)  # a missing field's pydantic input is every setting given
    assert "MESHSERVE_DEMO_NEEDED: Field required" in str(missing.value)
    with pytest.raises(ConfigError) as cross:
        load_settings(DemoSettings)  # a cross-field check's input is every setting too
    assert str(cross.value) == "invalid settings: peers must not exceed threads; lower MESHSERVE_DEMO_PEERS"
    for exc in (missing.value, cross.value):
        assert "s3cret-token" not in str(exc)


def test_a_bad_value_is_shown_unless_it_may_be_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSERVE_DEMO_PORT", "seventy")
    with pytest.raises(ConfigError, match=r"MESHSERVE_DEMO_PORT: .* \(got 'seventy'\)"):
        load_settings(DemoSettings)
    monkeypatch.setenv("MESHSERVE_DEMO_PORT", "redis://:pw@host")
    with pytest.raises(ConfigError) as exc:
        load_settings(DemoSettings)
    assert "MESHSERVE_DEMO_PORT" in str(exc.value) and "pw@" not in str(exc.value)


def test_unknown_yaml_keys_are_an_error_with_a_suggestion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "meshserve.yaml"
    config.write_text("demo:\n  thread: 3\n  colour: blue\nother:\n  anything: 1\n")  # other sections: not ours
    monkeypatch.setenv("MESHSERVE_CONFIG", str(config))
    with pytest.raises(ConfigError) as err:
        load_settings(DemoSettings)
    message = str(err.value)
    assert "section 'demo'" in message and str(config) in message
    assert "thread (did you mean threads?)" in message and "colour" in message
    assert "correct or remove them" in message


@pytest.mark.parametrize(
    ("host", "token", "exposed"),
    [
        ("127.0.0.1", None, False),
        ("::1", None, False),
        ("localhost", None, False),
        ("0.0.0.0", None, True),
        ("::", None, True),
        ("gateway", None, True),  # a host name may resolve beyond loopback
        ("0.0.0.0", "a-real-secret", False),
    ],
)
def test_dev_token_exposed_beyond_loopback(host: str, token: str | None, exposed: bool) -> None:
    settings = DemoSettings(host=host, **({"internal_token": token} if token else {}))
    assert settings.dev_token_exposed is exposed


_CLIENT_VARIABLES = {
    "address": "MESHSERVE_ADDRESS",
    "api_key": "MESHSERVE_API_KEY",
    "internal_token": "MESHSERVE_INTERNAL_TOKEN",
    "cache_address": "MESHSERVE_CACHE_ADDRESS",
    "router_address": "MESHSERVE_ROUTER_ADDRESS",
    "gateway_redis_url": "MESHSERVE_GATEWAY_REDIS_URL",
    "redis_url": "REDIS_URL",
    "state_file": "MESHSERVE_STATE_FILE",
}


def test_client_settings_default_to_the_local_mesh(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in _CLIENT_VARIABLES.values():
        monkeypatch.delenv(variable, raising=False)
    settings = ClientSettings()
    assert settings.address == "127.0.0.1:50051"
    assert settings.api_key is None  # the tools fall back to the local mesh's dev key
    assert settings.internal_token == DEFAULT_INTERNAL_TOKEN
    assert settings.cache_address == settings.router_address == settings.gateway_redis_url == ""
    assert settings.redis_url == settings.state_file == ""
    assert settings.state_path == Path.home() / ".cache" / "meshserve" / "mesh.json"


def test_client_settings_read_the_variables_users_set(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for field, variable in _CLIENT_VARIABLES.items():
        monkeypatch.setenv(variable, f"{field}-value")
    settings = ClientSettings()
    assert {field: getattr(settings, field) for field in _CLIENT_VARIABLES} == {
        field: f"{field}-value" for field in _CLIENT_VARIABLES
    }
    monkeypatch.setenv("MESHSERVE_STATE_FILE", str(tmp_path / "mesh.json"))
    assert ClientSettings().state_path == tmp_path / "mesh.json"
    monkeypatch.setenv("MESHSERVE_API_KEY", "")  # set but empty: as os.environ.get gave it
    assert ClientSettings().api_key == ""


def test_client_settings_names_are_case_sensitive_as_the_environment_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESHSERVE_ADDRESS", raising=False)
    monkeypatch.setenv("meshserve_address", "10.0.0.1:1")
    assert ClientSettings().address == "127.0.0.1:50051"
