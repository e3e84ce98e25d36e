"""redis-server as `meshserve up` starts it: no warning line in the relayed log."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.local.redis_server import (
    REDIS_OVERCOMMIT_NOTE,
    REDIS_STATE_OVERCOMMIT_NOTE,
    STATE_REDIS_ARGS,
    spawn_redis,
)

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


async def test_the_state_redis_starts_without_a_warning(tmp_path: Path) -> None:
    """With its append-only file the overcommit warning does apply (a rewrite forks): the note says how."""
    lines: list[str] = []
    proc, _url = await spawn_redis(
        str(tmp_path), lambda _name, line: lines.append(line), {}, args=STATE_REDIS_ARGS, name="redis-state"
    )
    try:
        assert proc.name == "redis-state"
    finally:
        await proc.stop()
    warnings = [line for line in lines if "WARNING" in line]
    assert not warnings, warnings
    assert REDIS_OVERCOMMIT_NOTE not in lines  # it says this Redis does not fork: not so here
    if _overcommit_off():
        assert lines.count(REDIS_STATE_OVERCOMMIT_NOTE) == 1, lines
