"""Log lines stay bounded: a caller-controlled value cannot make one huge."""

from __future__ import annotations

import json
import subprocess
import sys

from services.common.logging import MAX_FIELD_CHARS, cap_long_values


def test_long_string_values_are_cut_and_say_how_long_they_were() -> None:
    event = {"event": "x", "address": "a" * 40_000, "short": "ok", "count": 3}
    out = cap_long_values(None, "info", event)
    assert out["short"] == "ok" and out["count"] == 3
    assert out["address"].startswith("a" * MAX_FIELD_CHARS)
    assert out["address"].endswith("... (40000 characters, cut)")
    assert len(out["address"]) < MAX_FIELD_CHARS + 40


def test_a_configured_service_logs_a_bounded_line() -> None:
    code = (
        "import structlog\n"
        "from services.common.logging import configure_logging\n"
        "configure_logging('t')\n"
        "structlog.get_logger().info('event', prompt='p' * 100_000)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    line = done.stderr.strip().splitlines()[-1]
    assert len(line) < 2 * MAX_FIELD_CHARS
    assert json.loads(line)["prompt"].endswith("(100000 characters, cut)")
