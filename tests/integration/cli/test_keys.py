"""`meshserve keys` without --redis-url manages the keys of the mesh `meshserve up` runs: that mesh's
Redis listens on a port chosen at start, recorded in up's state file. A real redis-server."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from services import cli
from services.local.state import write_state

pytestmark = pytest.mark.integration


@pytest.fixture
def no_redis_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("MESHSERVE_GATEWAY_REDIS_URL", raising=False)
    monkeypatch.delenv("MESHSERVE_GATEWAY_STATE_REDIS_URL", raising=False)
    monkeypatch.setenv("MESHSERVE_STATE_FILE", str(tmp_path / "mesh.json"))
    return tmp_path


def created_key_id(out: str) -> str:
    return out.split("key id:")[1].split()[0]


def test_keys_go_to_the_redis_of_the_running_mesh(
    redis_url: str, no_redis_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_state({"gateway": "127.0.0.1:50051", "redis": redis_url})
    assert cli.main(["keys", "create", "--tenant", "acme", "--name", "ci"]) == 0
    key_id = created_key_id(capsys.readouterr().out)
    assert any(key_id in k.decode() for k in redis.Redis.from_url(redis_url).scan_iter(count=1000))
    assert cli.main(["keys", "list"]) == 0
    assert key_id in capsys.readouterr().out
    assert cli.main(["keys", "revoke", key_id]) == 0


def test_keys_go_to_the_state_redis_of_the_running_mesh(
    redis_url: str, no_redis_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`meshserve up` runs a cache Redis and a state Redis: keys are durable state, kept in the latter."""
    write_state({"gateway": "127.0.0.1:50051", "redis": "redis://127.0.0.1:1/0", "state_redis": redis_url})
    assert cli.main(["keys", "create", "--tenant", "acme", "--name", "ci"]) == 0
    key_id = created_key_id(capsys.readouterr().out)
    assert any(key_id in k.decode() for k in redis.Redis.from_url(redis_url).scan_iter(count=1000))
    assert cli.main(["keys", "revoke", key_id]) == 0


def test_the_gateways_state_redis_variable_wins_over_its_redis_variable(
    redis_url: str, no_redis_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MESHSERVE_GATEWAY_REDIS_URL", "redis://127.0.0.1:1/0")  # nothing listens there
    monkeypatch.setenv("MESHSERVE_GATEWAY_STATE_REDIS_URL", redis_url)
    assert cli.main(["keys", "list"]) == 0


def test_the_environment_and_the_flag_win_over_the_state_file(
    redis_url: str, no_redis_env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    write_state({"redis": "redis://127.0.0.1:1/0"})  # nothing listens there
    assert cli.main(["keys", "list"]) == 1
    assert "redis://127.0.0.1:1/0" in capsys.readouterr().err  # the error names the Redis it tried
    assert cli.main(["keys", "--redis-url", redis_url, "list"]) == 0
    monkeypatch.setenv("MESHSERVE_GATEWAY_REDIS_URL", redis_url)
    assert cli.main(["keys", "list"]) == 0


def test_with_no_mesh_up_the_default_is_the_local_redis_port(
    no_redis_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.cli.keys import DEFAULT_REDIS_URL, default_redis_url

    assert default_redis_url() == DEFAULT_REDIS_URL
