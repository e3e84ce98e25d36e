"""`meshserve frontdoor` argument handling (the running command is tested in tests/integration/frontdoor)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services import cli
from services.controlplane.server import parser


def test_defaults_are_the_container_ones() -> None:
    args = parser().parse_args(["--gateways", "gateway:50051"])
    assert (args.http_port, args.listen_host, args.adapters) == (8080, "0.0.0.0", 1)


def test_gateways_are_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["frontdoor"])
    assert exit_.value.code == 2
    assert "--gateways" in capsys.readouterr().err


# Startup errors run the command in a subprocess: it configures the process's logging (structlog on
# stderr), which must not leak into this test process.
def _frontdoor(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "services.cli", "frontdoor", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_a_gateway_without_a_port_is_one_line() -> None:
    done = _frontdoor("--gateways", "gateway", "--start-timeout", "1")
    assert done.returncode == 1
    assert done.stderr.strip() == "meshserve frontdoor: gateway 'gateway' must be host:port, e.g. gateway:50051"


def test_no_gateway_resolving_gives_up_at_the_deadline() -> None:
    timing = ("--start-timeout", "0.2", "--resolve-interval", "0.05")
    done = _frontdoor("--gateways", "no-such-host.invalid:50051", *timing)
    assert done.returncode == 1
    assert "no gateway address resolved from no-such-host.invalid:50051" in done.stderr
    assert "Traceback" not in done.stderr
