"""Worker.ImportKV / Worker.ExportKV, engine-agnostic: the prefix, its validation, the dispatch, the log.

An operator or the router pre-warms a replica with a prompt prefix from the shared Redis KV prefix
cache (import), or pushes a replica's prefix to Redis, e.g. before scaling it down (export).
Engines that keep Redis-shareable KV declare it (``EngineCapabilities.kv_transfer``, types.py) and
implement two methods:

* ``import_kv(prefix: KVPrefix) -> KVImport``: load the longest leading run of the prefix's full
  blocks that Redis holds into the engine's local prefix cache;
* ``export_kv(prefix: KVPrefix) -> KVExport``: write the leading run of the prefix's blocks the
  engine holds to Redis and wait for it (services.common.errors.Unavailable when Redis is down).

Both block (Redis I/O, a hand-off to the engine loop thread), so :func:`run` is called from a
thread, never from the event loop. They raise FailedPrecondition when the engine is configured
without a shareable cache; an engine that does not declare them (the edge tier's ONNX engines) gets the
same status here. Order of checks: engine capability, then the prefix (INVALID_ARGUMENT, the same
rules as a WorkerStart's prompt), then the engine's configuration.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import structlog

from services.common.errors import FailedPrecondition, InvalidArgument, MeshError
from services.worker.types import Engine, KVExport, KVImport, KVPrefix, validate_prompt

log = structlog.get_logger(__name__)
Op = Literal["import", "export"]


def prefix_ids(engine: Engine, token_ids: Sequence[int], text: str) -> tuple[int, ...]:
    """The prefix's token ids: ``token_ids`` as given, or ``text`` encoded as a plain prompt (no chat
    template, the tokenizer's post-processor as the router applies it), then validated."""
    if token_ids and text:
        raise InvalidArgument("set either prompt_token_ids or prompt_text, not both")
    if text:
        encoded = engine.tokenizer.encode(text)  # type: ignore[attr-defined]
        ids = tuple(int(i) for i in getattr(encoded, "ids", encoded))
    else:
        ids = tuple(token_ids)
    if not ids:
        raise InvalidArgument("the prefix is empty; send prompt_token_ids or a non-empty prompt_text")
    validate_prompt(ids, engine.info)
    return ids


def run(
    engine: Engine, op: Op, *, token_ids: Sequence[int], text: str, tenant: str, shareable: bool, tier: str
) -> KVImport | KVExport:
    """Validate the prefix and run ``import_kv`` / ``export_kv`` on ``engine`` (blocking); one log line."""
    try:
        if not engine.capabilities.kv_transfer:
            raise FailedPrecondition(
                f"this {tier} worker keeps no KV in the shared Redis prefix cache; "
                f"send {op.capitalize()}KV to a cloud worker started with a Redis URL"
            )
        prefix = KVPrefix(prefix_ids(engine, token_ids, text), tenant, shareable)
        result: KVImport | KVExport = engine.import_kv(prefix) if op == "import" else engine.export_kv(prefix)
    except MeshError as exc:
        log.info("kv_transfer_refused", op=op, code=exc.code, error=exc.message, kv_tenant=tenant, shareable=shareable)
        raise
    if isinstance(result, KVImport):
        log.info(
            "kv_import",
            prompt_tokens=result.prompt_tokens,
            blocks=result.blocks,
            held=result.held,
            imported=result.imported,
            redis_unavailable=result.redis_unavailable,
            kv_tenant=tenant,
            shareable=shareable,
        )
    else:
        log.info(
            "kv_export",
            prompt_tokens=result.prompt_tokens,
            blocks=result.blocks,
            written=result.written,
            not_held=result.not_held,
            kv_tenant=tenant,
            shareable=shareable,
        )
    return result
