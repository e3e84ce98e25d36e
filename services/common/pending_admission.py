"""An admission still in flight while the embedded router prepares its request.

With the router embedded in the gateway (services/gateway/local_router.py), the gateway starts the
router on a request while its rate-limit reservation (a Redis round trip) is still running, and
sets :data:`PENDING_ADMISSION` to that reservation. The router may do everything that costs no
worker anything (tokenize, look up the cache, choose a replica, open the worker call) but awaits
:func:`wait_admitted` before it sends the worker any work; the gateway awaits the same reservation
before it returns anything to the caller. A refused reservation raises its error at both places.
The variable is per task (a contextvar): it never leaks to another request.

**Speculative start.** When the gateway also sets :data:`SPECULATIVE` (at most a few requests per
tenant at a time, never for a tenant refused lately: services/gateway/admission.py), the router
starts the worker before the reservation is known (:func:`speculative_admission`), so the Redis round
trip overlaps the prefill instead of delaying it. The caller still gets nothing before admission; a
refusal aborts the worker's turn at once and the caller gets the refusal (:func:`refusal`).
"""

from __future__ import annotations

import asyncio
from contextvars import ContextVar
from typing import Any

PENDING_ADMISSION: ContextVar[asyncio.Future[Any] | None] = ContextVar("meshserve_pending_admission", default=None)
SPECULATIVE: ContextVar[bool] = ContextVar("meshserve_speculative_start", default=False)


async def wait_admitted() -> None:
    """Return once the current request's pending admission (if any) succeeded; raise its error if refused."""
    pending = PENDING_ADMISSION.get()
    if pending is not None:
        await asyncio.shield(pending)  # cancelling this waiter must not cancel the reservation itself


def speculative_admission() -> asyncio.Future[Any] | None:
    """The pending admission if the worker may start before it is known (see the module docstring)."""
    pending = PENDING_ADMISSION.get()
    if pending is None or pending.done() or not SPECULATIVE.get():
        return None
    return pending


def refusal() -> BaseException | None:
    """The current request's admission error, if its reservation has been refused."""
    pending = PENDING_ADMISSION.get()
    if pending is None or not pending.done() or pending.cancelled():
        return None
    return pending.exception()
