"""Gateway settings: deadline defaults must fit under their caps (else a config error says which), and every
setting is documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from services.common.config import ServiceSettings, load_settings
from services.common.errors import ConfigError
from services.gateway.config import GatewaySettings
from services.local.mesh import MeshConfig


def test_defaults_fit_under_their_caps() -> None:
    settings = load_settings(GatewaySettings)
    assert settings.default_deadline_s <= settings.max_deadline_s
    assert settings.default_chat_deadline_s <= settings.max_chat_deadline_s


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"DEFAULT_DEADLINE_S": "700"}, ("default_deadline_s (700)", "max_deadline_s (600)")),
        ({"MAX_CHAT_DEADLINE_S": "300"}, ("default_chat_deadline_s (900)", "max_chat_deadline_s (300)")),
    ],
)
def test_a_default_above_its_cap_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], names: tuple[str, ...]
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(f"MESHSERVE_GATEWAY_{key}", value)
    with pytest.raises(ConfigError) as err:
        load_settings(GatewaySettings)
    assert all(name in str(err.value) for name in names), str(err.value)
    assert "lower the default or raise the cap" in str(err.value)


def test_a_chat_cap_above_the_generate_cap_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSERVE_GATEWAY_MAX_CHAT_DEADLINE_S", "7200")
    monkeypatch.setenv("MESHSERVE_GATEWAY_DEFAULT_CHAT_DEADLINE_S", "3600")
    settings = load_settings(GatewaySettings)
    chat = (settings.default_chat_deadline_s, settings.max_chat_deadline_s)
    assert chat == (3600, 7200) and settings.max_deadline_s == 600


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "rediss://:pw@redis.example:6380/1",
        "redis+sentinel://s1:26379,s2:26379/mymaster/2",
        "redis+cluster://10.0.0.1:7000,10.0.0.2:7001",
        "",  # no Redis: static keys / JWT only
    ],
)
def test_redis_urls_of_every_kind_are_accepted(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.setenv("MESHSERVE_GATEWAY_REDIS_URL", url)
    assert load_settings(GatewaySettings).redis_url == url


@pytest.mark.parametrize(
    ("url", "fix"),
    [
        ("redis+sentinel://s1:26379", "must name the master"),
        ("127.0.0.1:6379", "unsupported Redis URL scheme"),
        ("http://redis:6379", "unsupported Redis URL scheme"),
        ("redis+cluster://h:notaport", "host:port"),
    ],
)
def test_a_malformed_redis_url_is_a_config_error(monkeypatch: pytest.MonkeyPatch, url: str, fix: str) -> None:
    monkeypatch.setenv("MESHSERVE_GATEWAY_REDIS_URL", url)
    with pytest.raises(ConfigError, match="MESHSERVE_GATEWAY_REDIS_URL") as err:
        load_settings(GatewaySettings)
    assert fix in str(err.value)


def test_the_state_redis_defaults_to_the_redis_and_is_checked_like_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSERVE_GATEWAY_REDIS_URL", "redis://cache:6379/0")
    assert load_settings(GatewaySettings).state_url == "redis://cache:6379/0"  # one Redis for everything
    monkeypatch.setenv("MESHSERVE_GATEWAY_STATE_REDIS_URL", "redis://state:6379/0")
    settings = load_settings(GatewaySettings)
    assert (settings.redis_url, settings.state_url) == ("redis://cache:6379/0", "redis://state:6379/0")
    monkeypatch.setenv("MESHSERVE_GATEWAY_STATE_REDIS_URL", "http://state:6379")
    with pytest.raises(ConfigError, match="MESHSERVE_GATEWAY_STATE_REDIS_URL: unsupported Redis URL scheme"):
        load_settings(GatewaySettings)


def test_every_gateway_setting_is_in_the_settings_table_of_the_docs() -> None:
    doc = (Path(__file__).parents[3] / "docs" / "gateway.md").read_text()
    section = doc[doc.index("## Settings") :]
    section = section[: section.index("\n## ", 1)]
    documented = set(re.findall(r"`([A-Z0-9_]+)`", section))
    own = set(GatewaySettings.model_fields) - set(ServiceSettings.model_fields)
    missing = sorted(name.upper() for name in own if name.upper() not in documented)
    assert missing == [], f"add these to the Settings table of docs/gateway.md: {missing}"
    common = (Path(__file__).parents[3] / "docs" / "architecture.md").read_text()
    missing_common = sorted(name.upper() for name in ServiceSettings.model_fields if f"`{name.upper()}`" not in common)
    assert missing_common == [], f"add these to the common settings table of docs/architecture.md: {missing_common}"


def test_the_router_runs_in_the_gateway_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSERVE_GATEWAY_API_KEYS", "dev:" + "a" * 64)
    for name in ("MESHSERVE_GATEWAY_EMBED_ROUTER", "MESHSERVE_GATEWAY_ROUTER_ADDRESS", "MESHSERVE_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    assert load_settings(GatewaySettings).embed_router is True
    assert MeshConfig().embed_router is True  # one default for the gateway and `meshserve up`


def test_a_router_address_means_the_split_layout_unless_embed_router_says_otherwise(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MESHSERVE_GATEWAY_API_KEYS", "dev:" + "a" * 64)
    monkeypatch.delenv("MESHSERVE_GATEWAY_EMBED_ROUTER", raising=False)
    monkeypatch.delenv("MESHSERVE_CONFIG", raising=False)
    monkeypatch.setenv("MESHSERVE_GATEWAY_ROUTER_ADDRESS", "router:50052")
    settings = load_settings(GatewaySettings)
    assert (settings.embed_router, settings.router_address) == (False, "router:50052")
    monkeypatch.setenv("MESHSERVE_GATEWAY_EMBED_ROUTER", "true")  # said explicitly: the address goes unused
    assert load_settings(GatewaySettings).embed_router is True
    monkeypatch.delenv("MESHSERVE_GATEWAY_EMBED_ROUTER")
    monkeypatch.delenv("MESHSERVE_GATEWAY_ROUTER_ADDRESS")
    config = tmp_path / "meshserve.yaml"
    config.write_text("gateway:\n  router_address: router:50052\n")
    monkeypatch.setenv("MESHSERVE_CONFIG", str(config))
    assert load_settings(GatewaySettings).embed_router is False
    assert GatewaySettings(router_address="127.0.0.1:1").embed_router is False
