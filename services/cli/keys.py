"""``meshserve keys create|list|revoke``: manage the API keys the gateway reads from Redis.

The plaintext of a new key is printed once, by ``create``; Redis only ever holds its SHA-256.
Keys are durable state: they live in the gateway's state Redis. The Redis URL comes from
``--redis-url``, else ``MESHSERVE_GATEWAY_STATE_REDIS_URL``, else ``MESHSERVE_GATEWAY_REDIS_URL``, else
the state Redis of the mesh ``meshserve up`` is running (recorded in its state file: it picks a free
port at start), else ``redis://127.0.0.1:6379/0``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from collections.abc import Sequence

from redis.exceptions import RedisError

from services.common.config import ClientSettings
from services.gateway.keystore import KeyRecord, KeyStore
from services.gateway.policy import POLICY_FIELDS
from services.local.state import recorded
from services.store.connection import redis_from_url

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
_DURATION = re.compile(r"^(\d+)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """``90s``, ``15m``, ``12h`` or ``30d`` in seconds."""
    match = _DURATION.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration; use e.g. 90s, 15m, 12h or 30d")
    return float(int(match.group(1)) * _UNITS[match.group(2)])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--redis-url",
        default=None,
        help="the gateway's state Redis (default: $MESHSERVE_GATEWAY_STATE_REDIS_URL, else "
        "$MESHSERVE_GATEWAY_REDIS_URL, else the state Redis of the mesh `meshserve up` runs, "
        f"else {DEFAULT_REDIS_URL})",
    )
    actions = parser.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    create = actions.add_parser("create", help="create a key and print it (shown only this once)")
    create.add_argument("--tenant", required=True, help="tenant the key belongs to")
    create.add_argument("--name", default="", help="a note for humans (who or what uses the key)")
    create.add_argument(
        "--scopes",
        default="",
        help="comma-separated scopes: inference (default: Generate, Complete, Chat, ListModels), "
        "models:read (ListModels only), * (everything)",
    )
    create.add_argument(
        "--models", default="", help="comma-separated model ids the key may use (default: every served model)"
    )
    create.add_argument("--expires-in", type=parse_duration, default=None, help="lifetime, e.g. 30d (default: none)")
    for name in POLICY_FIELDS:
        flag = "--" + name.replace("_", "-")
        create.add_argument(flag, type=int, default=None, dest=name, help=f"override the tenant's {name}")
    listing = actions.add_parser("list", help="list keys (never their plaintext)")
    listing.add_argument("--tenant", default=None, help="only this tenant's keys")
    listing.add_argument("--json", action="store_true", help="one JSON object per line")
    revoke = actions.add_parser("revoke", help="revoke a key by its id (effective on the next request)")
    revoke.add_argument("key_id", help="the id shown by `create` and `list`")


def _row(record: KeyRecord) -> dict[str, object]:
    return {
        "key_id": record.key_id,
        "tenant": record.tenant,
        "name": record.name,
        "scopes": list(record.scopes),
        "models": list(record.models),
        "limits": record.limits,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.created_at)),
        "expires_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.expires_at))
        if record.expires_at
        else None,
        "status": "revoked" if record.revoked else "expired" if record.expired() else "active",
    }


async def _run(args: argparse.Namespace) -> int:
    client = redis_from_url(args.redis_url, 5.0, read_timeout_s=5.0)  # ValueError (exit 2) for a malformed URL
    store = KeyStore(client)
    try:
        if args.keys_command == "create":
            limits = {name: getattr(args, name) for name in POLICY_FIELDS if getattr(args, name) is not None}
            scopes = [s.strip() for s in args.scopes.split(",") if s.strip()]
            models = [m.strip() for m in args.models.split(",") if m.strip()]
            plaintext, record = await store.create(
                args.tenant, scopes=scopes, limits=limits, ttl_s=args.expires_in, name=args.name, models=models
            )
            print(f"key id:  {record.key_id}\ntenant:  {record.tenant}\napi key: {plaintext}")
            print("Store the API key now: it is not shown again (Redis keeps only its SHA-256).", file=sys.stderr)
            return 0
        if args.keys_command == "list":
            rows = [_row(r) for r in await store.list(args.tenant)]
            if args.json:
                for row in rows:
                    print(json.dumps(row, sort_keys=True))
            else:
                print(f"{'KEY ID':<14}{'TENANT':<20}{'STATUS':<9}{'EXPIRES':<22}NAME")
                for row in rows:
                    expires = row["expires_at"] or "-"
                    print(f"{row['key_id']!s:<14}{row['tenant']!s:<20}{row['status']!s:<9}{expires!s:<22}{row['name']}")
            return 0
        if await store.revoke(args.key_id):
            print(f"revoked {args.key_id}")
            return 0
        print(f"meshserve keys revoke: no key with id {args.key_id!r}; see `meshserve keys list`", file=sys.stderr)
        return 1
    finally:
        await client.aclose()


def default_redis_url() -> str:
    """The Redis to use when ``--redis-url`` is not given (see the module docstring)."""
    settings = ClientSettings()
    return (
        settings.gateway_state_redis_url
        or settings.gateway_redis_url
        or recorded("state_redis")
        or recorded("redis")
        or DEFAULT_REDIS_URL
    )


def run(args: argparse.Namespace) -> int:
    if not args.redis_url:
        args.redis_url = default_redis_url()
    try:
        return asyncio.run(_run(args))
    except ValueError as exc:
        print(f"meshserve keys: {exc}", file=sys.stderr)
        return 2
    except (RedisError, OSError) as exc:
        print(f"meshserve keys: cannot reach Redis at {args.redis_url} ({exc}); pass --redis-url", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshserve keys", description="Manage the gateway's API keys.")
    add_arguments(parser)
    return run(parser.parse_args(argv))
