"""`meshserve cache` finds the cache service of the mesh `meshserve up` runs (its state file) when no
address is given, against the real admin service on port 0 and a real Redis."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from services import cli
from services.local.state import write_state
from tests.integration.cache.test_admin_service import TOKEN, serve

pytestmark = pytest.mark.integration


async def test_without_an_address_the_cli_asks_the_cache_of_the_running_mesh(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("MESHSERVE_CACHE_ADDRESS", raising=False)
    monkeypatch.setenv("MESHSERVE_STATE_FILE", str(tmp_path / "mesh.json"))
    server, _, channel = await serve(redis_url)
    try:
        write_state({"cache": f"127.0.0.1:{server.port}", "redis": redis_url})  # type: ignore[attr-defined]
        argv = ["cache", "--internal-token", TOKEN, "--json", "stats"]
        capsys.readouterr()  # the service's start log lines
        assert await asyncio.to_thread(cli.main, argv) == 0
        out = capsys.readouterr().out
        reply = json.loads(out[out.index("{\n") :])
        assert {k["kind"] for k in reply["kinds"]} == {"CACHE_KIND_RESPONSE", "CACHE_KIND_KV"}

        monkeypatch.setenv("MESHSERVE_CACHE_ADDRESS", "127.0.0.1:1")  # the environment wins over the state file
        assert await asyncio.to_thread(cli.main, argv) == 1
        assert "UNAVAILABLE" in capsys.readouterr().err
    finally:
        await channel.close()
        await server.stop()  # type: ignore[attr-defined]
