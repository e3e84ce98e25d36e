"""Heartbeat addresses: the forms a worker really has pass; anything else is INVALID_ARGUMENT, quoted short."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.router.frontend.registry_servicer import check_address


@pytest.mark.parametrize(
    "address",
    ["10.0.0.7:7101", "localhost:1", "edge-0.edge.default.svc.cluster.local:7101", "[::1]:65535", "[fd00::7]:7101"],
)
def test_worker_addresses_pass(address: str) -> None:
    check_address(address)


@pytest.mark.parametrize(
    "address",
    [
        "",
        "10.0.0.7",
        ":7101",
        "host:",
        "host:0",
        "host:65536",
        "host:٣",
        "ho st:1",
        "host\n:1",
        "-x:1",
        "a" * 300 + ":1",
    ],
)
def test_anything_else_is_refused(address: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        check_address(address)
    assert "must be host:port" in str(err.value)
    assert len(str(err.value)) < 200  # a 40,000-character address is not echoed whole


def test_a_huge_address_is_quoted_short() -> None:
    with pytest.raises(InvalidArgument) as err:
        check_address("x" * 40_000 + ":1")
    assert "x" * 64 + "..." in str(err.value)
