"""Worker settings for self-registration: router list, advertised address, model version."""

from __future__ import annotations

import pytest

from services.common.config import load_settings
from services.common.errors import ConfigError
from services.worker.config import WorkerSettings


def test_router_addresses_are_a_comma_list_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    class Settings(WorkerSettings):
        model_config = {"env_prefix": "MESHSERVE_TESTW_", "extra": "ignore"}  # type: ignore[assignment]

    monkeypatch.setenv("MESHSERVE_TESTW_ROUTER_ADDRESS", "10.0.0.1:50052, router-b:50052")
    assert load_settings(Settings).router_address == ["10.0.0.1:50052", "router-b:50052"]
    assert load_settings(WorkerSettings).router_address == []  # no registration by default


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("router_address", "router", "router address 'router' must be host:port"),
        ("router_address", "router:0", "must be host:port"),
        ("advertise_address", "10.0.0.7", "advertise_address '10.0.0.7' must be host:port"),
    ],
)
def test_bad_addresses_say_how_to_fix_them(field: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(WorkerSettings, **{field: value})


def test_advertised_address_and_model_version() -> None:
    assert load_settings(WorkerSettings).resolved_advertise_address(7101) == "127.0.0.1:7101"
    explicit = load_settings(WorkerSettings, advertise_address="edge-0:50061", model_version="v9")
    assert explicit.resolved_advertise_address(7101) == "edge-0:50061"
    assert explicit.resolved_model_version() == "v9"
    wildcard = load_settings(WorkerSettings, host="0.0.0.0")
    assert not wildcard.resolved_advertise_address(7101).startswith("0.0.0.0")
