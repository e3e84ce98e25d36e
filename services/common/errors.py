"""Transport-free domain errors. Raise these anywhere; one interceptor maps them to gRPC status.

Messages are shown to callers: one sentence that says what went wrong and how to fix it.
"""

from __future__ import annotations


class MeshError(Exception):
    """Base class of every error a caller may see. ``code`` names the gRPC status."""

    code = "INTERNAL"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(MeshError):
    """The request is malformed or out of range (bad parameter, empty or too-long prompt)."""

    code = "INVALID_ARGUMENT"


class NotFound(MeshError):
    """The request names something that does not exist (e.g. an unknown model)."""

    code = "NOT_FOUND"


class Unauthenticated(MeshError):
    """The caller's credentials are missing or wrong."""

    code = "UNAUTHENTICATED"


class PermissionDenied(MeshError):
    """The caller is known but may not do this."""

    code = "PERMISSION_DENIED"


class FailedPrecondition(MeshError):
    """The request is valid but this server is not in a state to run it (e.g. a worker without the
    KV prefix cache asked to import KV); retrying the same call here will not help."""

    code = "FAILED_PRECONDITION"


class ResourceExhausted(MeshError):
    """A limit was hit (rate limit, full queue); the caller may retry after ``retry_after_ms``."""

    code = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, retry_after_ms: int = 1000) -> None:
        super().__init__(message)
        self.retry_after_ms = max(0, int(retry_after_ms))


class Unavailable(MeshError):
    """No healthy backend can serve the request right now. ``retry_after_ms`` > 0: when to retry (a model
    that is waking up or whose wake failed: sent as the ``retry-after-ms`` trailer and HTTP
    ``Retry-After``); 0: no advice."""

    code = "UNAVAILABLE"

    def __init__(self, message: str, retry_after_ms: int = 0) -> None:
        super().__init__(message)
        self.retry_after_ms = max(0, int(retry_after_ms))


class DeadlineExceeded(MeshError):
    """The request's deadline passed before it finished."""

    code = "DEADLINE_EXCEEDED"


class Cancelled(MeshError):
    """The request was cancelled by the caller."""

    code = "CANCELLED"


class ConfigError(Exception):
    """Invalid configuration at start-up; the message says which setting and how to fix it."""
