"""ServiceProcess relays a child's log lines, and survives a line longer than its reader's limit;
``yield_on_wakeup`` puts every thread of a process under SCHED_BATCH."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from services.common.processes import LOG_LINE_LIMIT, ServiceProcess, yield_on_wakeup


async def test_a_line_over_the_limit_is_dropped_and_the_relay_goes_on() -> None:
    code = (
        "import sys\n"
        "print('before', flush=True)\n"
        f"sys.stdout.write('x' * {LOG_LINE_LIMIT * 2} + '\\n')\n"
        "print('after', flush=True)\n"
        f"sys.stdout.write('y' * {LOG_LINE_LIMIT + 10} + '\\n')\n"
        "print('last', flush=True)\n"
    )
    lines: list[str] = []
    proc = ServiceProcess("child", [sys.executable, "-c", code], {}, lambda _name, line: lines.append(line))
    await proc.spawn()
    assert proc.proc is not None
    assert await proc.proc.wait() == 0
    assert proc._relay is not None
    await proc._relay
    dropped = f"(a log line of over {LOG_LINE_LIMIT} bytes was dropped)"
    assert lines == ["before", dropped, "after", dropped, "last"]


def _policies(pid: int) -> list[int]:
    return [os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux-only")
async def test_yield_on_wakeup_covers_every_thread_and_the_threads_started_later() -> None:
    code = (
        "import os, sys, threading, time\n"
        "for _ in range(2):\n"
        "    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n"
        "later = []\n"
        "t = threading.Thread(target=lambda: later.append(os.sched_getscheduler(0)))\n"
        "t.start(); t.join()\n"
        "print('later', later[0], flush=True)\n"
    )
    lines: list[str] = []
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stdin is not None
    try:
        assert (await proc.stdout.readline()).strip() == b"ready"
        assert set(_policies(proc.pid)) == {os.SCHED_OTHER}
        assert len(_policies(proc.pid)) >= 3
        assert yield_on_wakeup(proc.pid)
        assert set(_policies(proc.pid)) == {os.SCHED_BATCH}
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
        lines.append((await proc.stdout.readline()).decode().strip())
        assert lines == [f"later {os.SCHED_BATCH}"]
        assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert not yield_on_wakeup(proc.pid)  # gone: nothing to change, no error
