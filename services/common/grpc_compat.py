"""A workaround for one grpc.aio client bug, applied once per process by :func:`patch_grpc_aio`.

grpc/grpc#36066 (fix proposed in grpc/grpc#43486): when the server ends a streaming-request call
(an error status, or an early end) while the client still writes, the failed write makes grpc.aio
call ``set_internal_error``, which overwrites the status the server had already sent. The caller
then sees ``INTERNAL: Internal error from Core`` instead of, say, ``NOT_FOUND`` — a race that hits
the gateway's relay of Chat frames to the router and any client that pipelines Chat frames.

The patched write does what the proposed fix does: when a write fails, wait (briefly) for the
status Core delivers for the call and report that; only when none comes does it fall back to the
local INTERNAL error (the case grpc/grpc#34148 guards against: a batch rejected synchronously, after
which Core may deliver no status). grpcio is pinned in pyproject.toml; :func:`patch_grpc_aio`
refuses to patch a version it was not written against, leaving grpc as it is.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import structlog
from grpc._cython import cygrpc
from grpc.aio import _call

log = structlog.get_logger(__name__)

PATCHED_VERSIONS = frozenset({"1.85.1"})
STATUS_WAIT_S = 1.0
"""How long a failed write waits for the server's status before reporting a local INTERNAL."""

_patched = False


async def _write(self: Any, request: Any) -> None:
    """``_StreamRequestMixin._write`` of grpcio 1.85.1 with the failed-write branch fixed."""
    if self.done():
        raise asyncio.InvalidStateError(_call._RPC_ALREADY_FINISHED_DETAILS)
    if self._done_writing_flag:
        raise asyncio.InvalidStateError(_call._RPC_HALF_CLOSED_DETAILS)
    if not self._metadata_sent.is_set():
        await self._metadata_sent.wait()
        if self.done():
            await self._raise_for_status()
    serialized_request = _call._common.serialize(request, self._request_serializer)
    try:
        await self._cython_call.send_serialized_message(serialized_request)
    except cygrpc.InternalError as err:
        try:
            await asyncio.wait_for(asyncio.shield(self._cython_call.status()), STATUS_WAIT_S)
        except TimeoutError:
            self._cython_call.set_internal_error(str(err))
        await self._raise_for_status()
    except asyncio.CancelledError:
        if not self.cancelled():
            self.cancel()
        raise


def patch_grpc_aio() -> bool:
    """Install the fixed write (idempotent). Returns whether grpc.aio is patched."""
    global _patched
    if _patched:
        return True
    if grpc.__version__ not in PATCHED_VERSIONS:
        log.warning("grpc_aio_not_patched", grpc_version=grpc.__version__, known=sorted(PATCHED_VERSIONS))
        return False
    _call._StreamRequestMixin._write = _write  # type: ignore[method-assign]
    _patched = True
    return True
