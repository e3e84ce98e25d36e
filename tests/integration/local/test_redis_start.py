"""redis-server as `meshserve up` starts it: no warning line in the relayed log."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.local.processes import REDIS_OVERCOMMIT_NOTE, spawn_redis

pytestmark = pytest.mark.integration
OVERCOMMIT = Path("/proc/sys/vm/overcommit_memory")


def _overcommit_off() -> bool:
    return OVERCOMMIT.exists() and OVERCOMMIT.read_text().strip() != "1"


async def test_redis_starts_without_a_warning(tmp_path: Path) -> None:
    lines: list[str] = []
    proc, url = await spawn_redis(str(tmp_path), lambda _name, line: lines.append(line), {})
    try:
        assert url.startswith("redis://127.0.0.1:")
    finally:
        await proc.stop()
    assert lines, "redis logged nothing at all"
    warnings = [line for line in lines if "WARNING" in line]
    assert not warnings, warnings
    if _overcommit_off():
        # The one warning only root can avoid is replaced by one line that explains it.
        assert lines.count(REDIS_OVERCOMMIT_NOTE) == 1, lines
