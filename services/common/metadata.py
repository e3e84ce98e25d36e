"""Names of the gRPC metadata keys meshserve carries across hops (lower-case, as gRPC requires)."""

from __future__ import annotations

from collections.abc import Iterable

REQUEST_ID = "x-request-id"
TENANT = "x-meshserve-tenant"
INTERNAL_TOKEN = "x-meshserve-internal-token"
RETRY_AFTER_MS = "retry-after-ms"
API_KEY = "x-api-key"
AUTHORIZATION = "authorization"
KEY_ID = "x-meshserve-key-id"
TENANT_SCOPE = "x-meshserve-tenant-scope"
"""Sent back by the gateway (response headers of Chat, trailers of every call) to a credential with
the inference scope: the digest of its tenant (services.store.keys.scope_tag), never the tenant in
clear. The HTTP adapter keys a tenant's stored /v1/responses by it."""

DEFAULT_RETRY_AFTER_MS = 1000
"""The retry delay assumed when a RESOURCE_EXHAUSTED status carries none (or an unreadable one)."""


def unreadable_key(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    """The first key whose text value is not printable ASCII, else None (``-bin`` values are bytes).

    gRPC allows only printable ASCII in text metadata. A value that is not valid UTF-8 at all reaches
    Python decoded as Latin-1 (grpc logs "Invalid encoding on ..."), so it shows up here as non-ASCII
    text; a caller behind Envoy's HTTP/1.1 listener can send one.
    """
    for key, value in metadata:
        if isinstance(value, str) and not (value.isascii() and value.isprintable()):
            return key
    return None


def retry_after_ms(trailing_metadata: Iterable[tuple[str, str | bytes]] | None) -> int:
    """The ``retry-after-ms`` delay in a call's trailing metadata (``DEFAULT_RETRY_AFTER_MS`` if absent
    or not a whole number of milliseconds)."""
    found = sent_retry_after_ms(trailing_metadata)
    return DEFAULT_RETRY_AFTER_MS if found is None else found


def sent_retry_after_ms(trailing_metadata: Iterable[tuple[str, str | bytes]] | None) -> int | None:
    """The ``retry-after-ms`` delay in a call's trailing metadata; None when it sent none (or an unreadable
    one): an UNAVAILABLE with the trailer was written by a mesh service, one without it may be the
    transport's own."""
    for key, value in trailing_metadata or ():
        if key == RETRY_AFTER_MS:
            text = value.decode() if isinstance(value, bytes) else str(value)
            return int(text) if text.isdigit() else None
    return None
