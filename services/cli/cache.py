"""``meshserve cache stats|flush|warm|where|import|export``: a thin client of the cache admin service
(``where``: of the router, see cache_where.py; ``import``/``export``: of a cloud worker, see cache_kv.py).

The address comes from ``--address``, else ``$MESHSERVE_CACHE_ADDRESS``, else the mesh ``meshserve up``
is running (its state file; it also prints the address); the internal credential from
``--internal-token`` or ``$MESHSERVE_INTERNAL_TOKEN``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence

import grpc
from google.protobuf.json_format import MessageToDict

from services.cli import cache_kv, cache_where
from services.common import metadata as md
from services.common.config import ClientSettings
from services.common.pb.meshserve.internal.v1 import cache_pb2, cache_pb2_grpc
from services.local.state import recorded

_KINDS = {
    "all": cache_pb2.CACHE_KIND_UNSPECIFIED,
    "response": cache_pb2.CACHE_KIND_RESPONSE,
    "kv": cache_pb2.CACHE_KIND_KV,
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshserve cache", description="Administer meshserve's Redis caches.")
    p.add_argument(
        "--address",
        default="",
        help="cache service host:port (default: $MESHSERVE_CACHE_ADDRESS, else the mesh `meshserve up` runs)",
    )
    p.add_argument(
        "--internal-token",
        default=ClientSettings().internal_token,
        help="internal credential (default: $MESHSERVE_INTERNAL_TOKEN or the local dev token)",
    )
    p.add_argument("--json", action="store_true", help="print the reply as JSON")
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    sub.add_parser("stats", help="hit ratio by kind, entries, bytes, Redis memory")
    flush = sub.add_parser("flush", help="delete entries by tenant, model, model version or shared")
    flush.add_argument("--tenant", default="", help="only this tenant's private entries")
    flush.add_argument("--model", default="", help="only this model id")
    flush.add_argument("--model-version", default="", help="only this model version")
    flush.add_argument("--kind", choices=sorted(_KINDS), default="all", help="only this cache kind")
    flush.add_argument("--shared", action="store_true", help="only entries shared across tenants")
    flush.add_argument("--all", action="store_true", help="everything (needed when no filter is given)")
    warm = sub.add_parser("warm", help="send shared system prompts through the router once")
    warm.add_argument("prompts", nargs="+", help="prompts to warm (quote each one)")
    warm.add_argument("--max-tokens", type=int, default=1, help="tokens to generate per prompt (default 1)")
    cache_where.add_parser(sub)
    cache_kv.add_parsers(sub)
    return p


def _request(args: argparse.Namespace) -> tuple[str, object]:
    if args.action == "stats":
        return "Stats", cache_pb2.CacheStatsRequest()
    if args.action == "flush":
        return "Flush", cache_pb2.FlushRequest(
            kind=_KINDS[args.kind],
            model_id=args.model,
            model_version=args.model_version,
            tenant=args.tenant,
            shared=args.shared,
            all=args.all,
        )
    return "Warm", cache_pb2.WarmRequest(prompts=args.prompts, max_tokens=args.max_tokens)


def _print(reply: object, as_json: bool) -> None:
    data = MessageToDict(reply, always_print_fields_with_no_presence=True)  # type: ignore[arg-type]
    if as_json or not isinstance(reply, cache_pb2.CacheStatsResponse):
        print(json.dumps(data, indent=2))
        return
    print(f"{'kind':<9} {'hit ratio':>9} {'hits':>8} {'misses':>8} {'errors':>7} {'entries':>8} {'bytes':>12}")
    for k in reply.kinds:
        name = cache_pb2.CacheKind.Name(k.kind).removeprefix("CACHE_KIND_").lower()
        print(f"{name:<9} {k.hit_ratio:>9.3f} {k.hits:>8} {k.misses:>8} {k.errors:>7} {k.entries:>8} {k.bytes:>12}")
    print(
        f"redis: used {reply.redis_used_memory_bytes} B, maxmemory {reply.redis_maxmemory_bytes} B, "
        f"policy {reply.redis_maxmemory_policy or '?'}"
    )


async def _call(args: argparse.Namespace) -> object:
    method, request = _request(args)
    async with grpc.aio.insecure_channel(args.address) as channel:
        stub = cache_pb2_grpc.CacheStub(channel)
        call = getattr(stub, method)
        return await call(request, metadata=((md.INTERNAL_TOKEN, args.internal_token),), timeout=300)


def _where(args: argparse.Namespace) -> int:
    address = cache_where.router_address(args)
    if not address:
        print(
            "meshserve cache where: no router address; pass --router host:port, set MESHSERVE_ROUTER_ADDRESS "
            "or start the mesh with `meshserve up`",
            file=sys.stderr,
        )
        return 2
    try:
        reply = asyncio.run(cache_where.locate(address, cache_where.request(args), args.internal_token))
    except grpc.aio.AioRpcError as exc:
        print(f"meshserve cache where: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(cache_where.render(reply, args.json))
    if hint := cache_where.tenant_hint(args, reply):
        print(hint)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.action == "where":
        return _where(args)
    if args.action in cache_kv.ACTIONS:
        return cache_kv.main(args)
    args.address = args.address or ClientSettings().cache_address or recorded("cache")
    if not args.address:
        print(
            "meshserve cache: no cache service address; pass --address host:port, set MESHSERVE_CACHE_ADDRESS "
            "or start the mesh with `meshserve up`",
            file=sys.stderr,
        )
        return 2
    try:
        reply = asyncio.run(_call(args))
    except grpc.aio.AioRpcError as exc:
        print(f"meshserve cache: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    _print(reply, args.json)
    return 0
