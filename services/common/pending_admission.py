"""An admission still in flight while the embedded router prepares its request.

With the router embedded in the gateway (services/gateway/local_router.py), the gateway starts the
router on a request while its rate-limit reservation (a Redis round trip) is still running, and
sets :data:`PENDING_ADMISSION` to that reservation. The router may do everything that costs no
worker anything (tokenize, look up the cache, choose a replica, open the worker call) but awaits
:func:`wait_admitted` before it sends the worker any work; the gateway awaits the same reservation
before it returns anything to the caller. A refused reservation raises its error at both places.
The variable is per task (a contextvar): it never leaks to another request.
"""

from __future__ import annotations

import asyncio
from contextvars import ContextVar
from typing import Any

PENDING_ADMISSION: ContextVar[asyncio.Future[Any] | None] = ContextVar("meshserve_pending_admission", default=None)


async def wait_admitted() -> None:
    """Return once the current request's pending admission (if any) succeeded; raise its error if refused."""
    pending = PENDING_ADMISSION.get()
    if pending is not None:
        await asyncio.shield(pending)  # cancelling this waiter must not cancel the reservation itself
