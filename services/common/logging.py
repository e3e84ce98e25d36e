"""structlog JSON logging with request-scoped context from contextvars.

Bind per-request fields with ``structlog.contextvars.bind_contextvars(request_id=..., tenant=...)``;
they appear on every log line of that task.
"""

from __future__ import annotations

import logging
import sys

import structlog

MAX_FIELD_CHARS = 4096
"""A log field's string value is cut to this many characters: values a caller controls (a prompt, an
address, an error message quoting them) must not make a log line unbounded (``meshserve up`` relays
children's lines, and a collector drops or splits huge ones)."""


def cap_long_values(_logger: object, _method: str, event: structlog.types.EventDict) -> structlog.types.EventDict:
    """Cut every string value longer than ``MAX_FIELD_CHARS``, saying how long it was."""
    for key, value in event.items():
        if isinstance(value, str) and len(value) > MAX_FIELD_CHARS:
            event[key] = f"{value[:MAX_FIELD_CHARS]}... ({len(value)} characters, cut)"
    return event


class _GrpcDecodeNoise(logging.Filter):
    """Drops grpc's "Invalid encoding on <bytes>" records: grpc logs one, with a traceback, each time a
    handler reads metadata holding bytes that are not UTF-8. The gateway refuses such a call with
    INVALID_ARGUMENT naming the key (``metadata.unreadable_key``), which is the useful record."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Invalid encoding on")


_GRPC_LOGGER = "grpc._cython.cygrpc"


def quiet_grpc_decode_errors() -> None:
    """Install :class:`_GrpcDecodeNoise` on grpc's logger (once per process; idempotent)."""
    logger = logging.getLogger(_GRPC_LOGGER)
    if not any(isinstance(f, _GrpcDecodeNoise) for f in logger.filters):
        logger.addFilter(_GrpcDecodeNoise())


def configure_logging(service: str, level: str = "INFO", json: bool = True) -> None:
    """Configure structlog for a service process: one JSON object per line on stderr."""
    log_level = logging.getLevelName(level.upper())
    if not isinstance(log_level, int):
        log_level = logging.INFO
    logging.basicConfig(stream=sys.stderr, level=log_level, format="%(message)s")
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            cap_long_values,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(log_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
