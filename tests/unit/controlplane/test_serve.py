"""`meshserve frontdoor` argument handling (the running command is tested in tests/integration/frontdoor)."""

from __future__ import annotations

import pytest

from services import cli
from services.controlplane.serve import parser


def test_defaults_are_the_container_ones() -> None:
    args = parser().parse_args(["--gateways", "gateway:50051"])
    assert (args.http_port, args.listen_host, args.adapters) == (8080, "0.0.0.0", 1)


def test_gateways_are_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["frontdoor"])
    assert exit_.value.code == 2
    assert "--gateways" in capsys.readouterr().err


def test_a_gateway_without_a_port_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["frontdoor", "--gateways", "gateway", "--start-timeout", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "meshserve frontdoor: gateway 'gateway' must be host:port, e.g. gateway:50051"


def test_no_gateway_resolving_gives_up_at_the_deadline(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["frontdoor", "--gateways", "no-such-host.invalid:50051", "--start-timeout", "0.2"]
    args += ["--resolve-interval", "0.05"]
    assert cli.main(args) == 1
    assert "no gateway address resolved from no-such-host.invalid:50051" in capsys.readouterr().err
