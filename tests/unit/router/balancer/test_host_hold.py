"""The router's host flag (services/router/balancer/host_hold.py): set for every worker of a host when its
foreground count leaves 0, renewed while it stays above, cleared when it returns to 0."""

from __future__ import annotations

import asyncio

from services.router.balancer.host_hold import HostHold, host_of

WORKERS = ["10.0.0.1:50061", "10.0.0.1:50062", "10.0.0.2:50061"]


def test_a_host_is_the_address_without_its_port() -> None:
    assert host_of("127.0.0.1:50061") == "127.0.0.1"
    assert host_of("[::1]:50061") == "::1"
    assert host_of("edge-0.edge:50061") == "edge-0.edge"


async def test_the_flag_goes_to_the_hosts_workers_on_the_first_turn_and_is_cleared_after_the_last() -> None:
    sent: list[tuple[str, int]] = []
    hold = HostHold(lambda address, ttl_ms: sent.append((address, ttl_ms)), lambda: WORKERS, ttl_s=1.0, renew_s=60)
    hold.started("10.0.0.1:50061")
    assert sent == [("10.0.0.1:50061", 1000), ("10.0.0.1:50062", 1000)]  # both workers of the host, not .2
    hold.started("10.0.0.1:50062")
    hold.ended("10.0.0.1:50061")
    assert len(sent) == 2  # the count went 1 -> 2 -> 1: nothing to say
    hold.ended("10.0.0.1:50062")
    assert sent[2:] == [("10.0.0.1:50061", 0), ("10.0.0.1:50062", 0)]
    assert not hold.busy("10.0.0.1")
    await hold.close()


async def test_the_flag_is_renewed_while_turns_run_and_no_longer_after() -> None:
    sent: list[tuple[str, int]] = []
    hold = HostHold(lambda address, ttl_ms: sent.append((address, ttl_ms)), lambda: WORKERS[2:], renew_s=0.01)
    hold.started("10.0.0.2:50061")
    for _ in range(500):  # bounded: a few renewals
        if len(sent) >= 4:
            break
        await asyncio.sleep(0.01)
    assert len(sent) >= 4 and all(ttl > 0 for _, ttl in sent)
    hold.ended("10.0.0.2:50061")
    assert sent[-1] == ("10.0.0.2:50061", 0)
    count = len(sent)
    await asyncio.sleep(0.05)
    assert len(sent) == count  # the renewer stopped with the last turn
    await hold.close()
