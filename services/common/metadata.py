"""Names of the gRPC metadata keys meshserve carries across hops (lower-case, as gRPC requires)."""

from __future__ import annotations

REQUEST_ID = "x-request-id"
TENANT = "x-meshserve-tenant"
INTERNAL_TOKEN = "x-meshserve-internal-token"
RETRY_AFTER_MS = "retry-after-ms"
API_KEY = "x-api-key"
AUTHORIZATION = "authorization"
KEY_ID = "x-meshserve-key-id"
