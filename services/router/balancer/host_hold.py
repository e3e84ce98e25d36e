"""The host's foreground flag: while this router runs a foreground turn on any worker of a host, the
background sequences (batch lines) of every worker of that host sit out their engines' rounds.

Workers on one host share its cores, so a batch line decoding on worker B slows an interactive turn
on worker A of the same machine as much as one beside it on A. The router knows every turn it runs
and where (``Router._serve``), so it counts its foreground turns per host and tells the host's
workers when the count goes from 0 to more (``ttl_s``, renewed every ``renew_s`` while it stays
above 0) and back to 0 (a ttl of 0). The message rides on the router's connection to each worker
(``MuxRequest.background_hold``): no call, no per-token message, nothing awaited.

A host is the host part of a worker's address (:func:`host_of`, e.g. ``127.0.0.1`` for
``127.0.0.1:50061``): the workers ``meshserve up`` starts on one machine share it; containers and
pods have addresses of their own and are not grouped (their CPU limits keep them apart). Only
workers this router has a connection to get the flag (a worker it has never sent a turn to runs
none of its lines); several routers each send their own, and a worker holds while any of them is set.

A flag is never left set: each one expires ``ttl_s`` after it was last sent, so a router that dies,
hangs or loses its connection stops holding the lines within ``ttl_s``; the engine bounds every
hold by its own max hold time as well (services/edge_worker/hold.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable

import structlog

log = structlog.get_logger(__name__)

HOLD_TTL_S = 1.0
"""How long a flag holds unless renewed."""
RENEW_S = 0.25
"""How often a host's flag is sent again while this router runs foreground turns there."""


def host_of(address: str) -> str:
    """The host part of a ``host:port`` address (IPv6 brackets kept off): the grouping key."""
    host = address.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


Send = Callable[[str, int], None]
"""``send(worker address, ttl_ms)``: put the flag on the router's connection to that worker (none: drop it)."""


class HostHold:
    """Counts this router's foreground turns per host and sets the hosts' flags (see the module docstring)."""

    def __init__(
        self, send: Send, addresses: Callable[[], Iterable[str]], *, ttl_s: float = HOLD_TTL_S, renew_s: float = RENEW_S
    ) -> None:
        """``addresses``: every worker address the router knows now (the registry's replicas)."""
        self._send = send
        self._addresses = addresses
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._renew_s = renew_s
        self._busy: dict[str, int] = {}
        """Foreground turns in flight per host (hosts with none are absent)."""
        self._renewer: asyncio.Task[None] | None = None
        self.signals = 0
        """Flags sent (set, renewed or cleared), counted per worker."""

    def busy(self, host: str) -> bool:
        return host in self._busy

    def started(self, address: str) -> None:
        """A foreground turn starts on the worker at ``address``."""
        host = host_of(address)
        count = self._busy.get(host, 0) + 1
        self._busy[host] = count
        if count == 1:
            self._signal(host, self._ttl_ms)
            if self._renewer is None or self._renewer.done():
                self._renewer = asyncio.get_running_loop().create_task(self._renew())

    def ended(self, address: str) -> None:
        """A foreground turn on the worker at ``address`` ended (however it ended)."""
        host = host_of(address)
        count = self._busy.get(host, 0) - 1
        if count > 0:
            self._busy[host] = count
            return
        self._busy.pop(host, None)
        self._signal(host, 0)

    def _signal(self, host: str, ttl_ms: int) -> None:
        for address in self._addresses():
            if host_of(address) == host:
                self._send(address, ttl_ms)
                self.signals += 1

    async def _renew(self) -> None:
        while self._busy:
            await asyncio.sleep(self._renew_s)
            for host in list(self._busy):
                self._signal(host, self._ttl_ms)

    async def close(self) -> None:
        renewer, self._renewer = self._renewer, None
        if renewer is not None:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
