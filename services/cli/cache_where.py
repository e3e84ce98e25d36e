"""``meshserve cache where "<prompt>"``: which replicas, and Redis, hold how many of a prompt's KV blocks
(of the default model's primary version, or of ``--model`` and ``--version``).

A thin client of ``RouterAdmin.PrefixLocation`` (the router knows what its workers hold and asks
Redis once; see services/router/frontend/location.py). The router's address comes from ``--router``, else
``$MESHSERVE_ROUTER_ADDRESS``, else the mesh ``meshserve up`` runs (its state file); both layouts
serve it (the router as its own process, or embedded in the gateway).
"""

from __future__ import annotations

import argparse
import json

import grpc
from google.protobuf.json_format import MessageToDict

from services.common import metadata as md
from services.common.config import ClientSettings
from services.common.pb.meshserve.internal.v1 import router_admin_pb2, router_admin_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2
from services.local.state import recorded

_TIERS = {"auto": inference_pb2.TIER_AUTO, "edge": inference_pb2.TIER_EDGE, "cloud": inference_pb2.TIER_CLOUD}
_TIER_NAMES = {inference_pb2.TIER_EDGE: "edge", inference_pb2.TIER_CLOUD: "cloud"}
_UNKNOWN = {
    router_admin_pb2.REDIS_LOOKUP_UNAVAILABLE: "unknown (Redis did not answer)",
    router_admin_pb2.REDIS_LOOKUP_DISABLED: "unknown (the router has no Redis)",
}


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """The ``where`` action of ``meshserve cache``."""
    p = sub.add_parser("where", help="which replicas and Redis hold how many KV blocks of a prompt's prefix")
    p.add_argument("prompt", help="the prompt (quote it)")
    p.add_argument("--tenant", default="", help="the tenant (its API key's) whose blocks to look for")
    p.add_argument("--shareable", action="store_true", help="look for blocks shared across tenants")
    p.add_argument(
        "--tier", choices=sorted(_TIERS), default="auto", help="replicas of this tier (default: the router's choice)"
    )
    p.add_argument("--chat", action="store_true", help="the prompt is a chat's user message (chat template applied)")
    p.add_argument("--model", default="", help="the served model to look at (default: the router's default model)")
    p.add_argument(
        "--version", default="", help="that model's version, by its name in the models file (default: its primary)"
    )
    p.add_argument(
        "--router",
        default="",
        help="router host:port (default: $MESHSERVE_ROUTER_ADDRESS, else the mesh `meshserve up` runs)",
    )


def router_address(args: argparse.Namespace) -> str:
    """``--router``, ``$MESHSERVE_ROUTER_ADDRESS`` or the running mesh's router; "" when none."""
    return str(args.router or ClientSettings().router_address or recorded("router"))


def request(args: argparse.Namespace) -> router_admin_pb2.PrefixLocationRequest:
    req = router_admin_pb2.PrefixLocationRequest(
        tenant=args.tenant,
        shareable_prefix=args.shareable,
        tier=_TIERS[args.tier],
        model=args.model,
        version=args.version,
    )
    if args.chat:
        req.messages.append(inference_pb2.ChatMessage(role="user", content=args.prompt))
    else:
        req.text = args.prompt
    return req


async def locate(
    address: str, req: router_admin_pb2.PrefixLocationRequest, token: str
) -> router_admin_pb2.PrefixLocationResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_admin_pb2_grpc.RouterAdminStub(channel)
        return await stub.PrefixLocation(req, metadata=((md.INTERNAL_TOKEN, token),), timeout=30)


def render(reply: router_admin_pb2.PrefixLocationResponse, as_json: bool = False) -> str:
    """The reply as a small table (or JSON)."""
    if as_json:
        return json.dumps(MessageToDict(reply, always_print_fields_with_no_presence=True), indent=2)
    tier = _TIER_NAMES.get(reply.tier, "?")
    blocks = f"{reply.prompt_blocks} full block{'' if reply.prompt_blocks == 1 else 's'}"
    lines = [
        f"model:  {reply.model_id} version {reply.version or '-'}",
        f"prompt: {reply.prompt_tokens} tokens, {blocks} of {reply.block_tokens} tokens",
        f"tier:   {tier} ({reply.tier_reason})",
        "",
        f"{'replica':<24} {'address':<22} {'blocks held':>11}",
    ]
    for r in reply.replicas:
        lines.append(f"{r.worker_id or '-':<24} {r.address:<22} {r.cached_blocks:>11}")
    if not reply.replicas:
        lines.append(f"{'(no healthy ' + tier + ' replica)':<24}")
    redis = _UNKNOWN.get(reply.redis, f"{reply.redis_blocks:>11}")
    lines.append(f"{'redis':<24} {'':<22} {redis}")
    scope = f"{reply.model_id} version {reply.model_version[:12]}, {reply.redis_block_tokens}-token blocks"
    lines.append(f"(redis: looked at up to {reply.redis_checked_blocks} blocks of {scope})")
    return "\n".join(lines)


def tenant_hint(args: argparse.Namespace, reply: router_admin_pb2.PrefixLocationResponse) -> str | None:
    """A hint when no cloud replica nor Redis holds any block and no tenant was given: keys are salted
    by tenant, so a prompt sent with an API key is found only under that key's tenant (``dev`` for the
    local mesh). Not for the edge tier, whose workers keep no shared prefix blocks."""
    if args.tenant or args.shareable or args.json or reply.prompt_blocks == 0 or reply.tier != inference_pb2.TIER_CLOUD:
        return None
    if any(r.cached_blocks for r in reply.replicas) or reply.redis_blocks:
        return None
    return (
        "hint: KV blocks are kept per tenant; pass --tenant with the tenant of the API key that sent the "
        "prompt (dev for the local mesh's development key), or --shareable for shared prefixes"
    )
