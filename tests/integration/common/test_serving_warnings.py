"""A service that listens beyond loopback with the development internal token says so at start."""

from __future__ import annotations

from structlog.testing import capture_logs

from services.common.config import ServiceSettings
from services.common.serving import start_server


class _Exposed(ServiceSettings):
    """Reports itself exposed while still binding loopback (tests never listen beyond it)."""

    @property
    def dev_token_exposed(self) -> bool:
        return True


async def _warnings(settings: ServiceSettings) -> list[dict[str, object]]:
    with capture_logs() as logs:
        running = await start_server(settings, register=lambda _server: None, service_names=[])
        await running.stop()
    return [entry for entry in logs if entry["event"] == "internal_token_is_the_dev_default"]


async def test_the_dev_token_beyond_loopback_is_a_warning_at_start() -> None:
    (warning,) = await _warnings(_Exposed(host="127.0.0.1", port=0, metrics_port=-1, shutdown_grace_s=0))
    assert warning["log_level"] == "warning"
    assert warning["fix"] == "set MESHSERVE_COMMON_INTERNAL_TOKEN (the same secret on every service)"


async def test_loopback_with_the_dev_token_says_nothing() -> None:
    assert await _warnings(ServiceSettings(host="127.0.0.1", port=0, metrics_port=-1, shutdown_grace_s=0)) == []
