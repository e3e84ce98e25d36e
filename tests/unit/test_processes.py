"""ServiceProcess relays a child's log lines, and survives a line longer than its reader's limit."""

from __future__ import annotations

import sys

from services.processes import LOG_LINE_LIMIT, ServiceProcess


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
