"""``meshserve cache import|export "<prompt>"``: pre-warm one cloud replica from Redis, or drain it to Redis.

A thin client of the cloud worker's ``Worker.ImportKV`` (the longest leading run of the prompt's
full KV blocks that Redis holds goes into the replica's local prefix cache) and ``Worker.ExportKV``
(the leading run of the prompt's blocks the replica holds is written to Redis, synchronously); see
docs/cloud.md. Both carry the internal credential (``--internal-token``, else
``$MESHSERVE_INTERNAL_TOKEN``, else the local development token), like every internal call.

The worker is ``--worker host:port``, else the one cloud replica the router knows
(``RouterAdmin.ListReplicas`` on ``--router``, ``$MESHSERVE_ROUTER_ADDRESS`` or the router of the
mesh ``meshserve up`` runs): with none or several, a one-line error lists them and asks for
``--worker``.

The prompt: plain text goes as ``prompt_text`` and the worker tokenizes it with its own tokenizer
as a plain prompt, which is how the router tokenizes a Generate prompt, so the blocks are the ones a
Generate request with that prompt reuses. ``--chat`` (the prompt as a chat's one user message, as
``where --chat``) is templated here, because the worker has no chat-template endpoint: the same
code the router runs (services.common.tokenizer) on the tokenizer and chat template of
``--tokenizer-dir`` (default: the prepared model's hf dir, which the router also defaults to), sent
as token ids. That tokenizer must be the worker's: another one gives other ids, so other block keys.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict

from services.cli import cache_where
from services.common import metadata as md
from services.common.errors import ConfigError, MeshError
from services.common.pb.meshserve.internal.v1 import (
    router_admin_pb2,
    router_admin_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.pb.meshserve.v1 import inference_pb2

ACTIONS = ("import", "export")
DEFAULT_TIMEOUT_S = 30.0
Reply = worker_pb2.KvImportResponse | worker_pb2.KvExportResponse


class UsageError(Exception):
    """What the command cannot do as asked (no worker to call, a prompt that cannot be templated)."""


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """The ``import`` and ``export`` actions of ``meshserve cache``."""
    helps = {
        "import": "pre-warm a cloud worker: load the prompt's KV blocks Redis holds into its local prefix cache",
        "export": "write the prompt's KV blocks a cloud worker holds to Redis (e.g. before scaling it down)",
    }
    for action in ACTIONS:
        p = sub.add_parser(action, help=helps[action], description=helps[action])
        p.add_argument("prompt", help="the prompt (quote it)")
        p.add_argument(
            "--worker",
            default="",
            help="cloud worker host:port (default: the one cloud replica of the router, if it knows exactly one)",
        )
        p.add_argument("--tenant", default="", help="the tenant (its API key's) whose KV blocks are meant")
        p.add_argument("--shareable", action="store_true", help="the blocks shared across tenants")
        p.add_argument(
            "--chat",
            action="store_true",
            help="the prompt is a chat's user message (chat template applied here, see --tokenizer-dir)",
        )
        p.add_argument(
            "--tokenizer-dir",
            type=Path,
            default=None,
            help="with --chat: HF dir of the worker's tokenizer and chat template (default: the prepared model's)",
        )
        p.add_argument(
            "--router",
            default="",
            help="router to find the cloud worker with when --worker is not given "
            "(default: $MESHSERVE_ROUTER_ADDRESS, else the mesh `meshserve up` runs)",
        )
        p.add_argument(
            "--timeout",
            type=_seconds,
            default=DEFAULT_TIMEOUT_S,
            help=f"seconds to wait (default {DEFAULT_TIMEOUT_S:g})",
        )
        # SUPPRESS: given before the action (`meshserve cache --json import ...`), the value stays.
        p.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print the reply as JSON")
        p.add_argument(
            "--internal-token",
            default=argparse.SUPPRESS,
            help="internal credential (as `meshserve cache --internal-token`)",
        )


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _chat_ids(prompt: str, tokenizer_dir: Path | None) -> list[int]:
    from services.common.model_paths import model_paths
    from services.common.tokenizer import Tokenizer

    try:
        return Tokenizer(tokenizer_dir or model_paths().hf_dir).apply_chat_template(
            [{"role": "user", "content": prompt}]
        )
    except (ConfigError, MeshError) as exc:
        raise UsageError(str(exc)) from None


def request(args: argparse.Namespace) -> worker_pb2.KvPrefixRequest:
    """The KvPrefixRequest of the arguments: the text, or with ``--chat`` the templated token ids."""
    req = worker_pb2.KvPrefixRequest(tenant=args.tenant, shareable_prefix=args.shareable)
    if args.chat:
        req.prompt_token_ids.extend(_chat_ids(args.prompt, args.tokenizer_dir))
    else:
        req.prompt_text = args.prompt
    return req


async def cloud_replicas(router: str, token: str, timeout_s: float) -> list[router_admin_pb2.ReplicaStatus]:
    """The cloud replicas the router knows, healthy or not."""
    async with grpc.aio.insecure_channel(router) as channel:
        reply = await router_admin_pb2_grpc.RouterAdminStub(channel).ListReplicas(
            router_admin_pb2.ListReplicasRequest(), metadata=((md.INTERNAL_TOKEN, token),), timeout=timeout_s
        )
    return [r for r in reply.replicas if r.tier == inference_pb2.TIER_CLOUD]


async def find_worker(args: argparse.Namespace) -> str:
    """``--worker``, else the router's only cloud replica; UsageError (saying what to pass) otherwise, and
    the router's AioRpcError when it cannot be asked."""
    if args.worker:
        return str(args.worker)
    router = cache_where.router_address(args)
    if not router:
        raise UsageError(
            "no cloud worker address; pass --worker host:port (`meshserve status` lists the replicas), "
            "or --router host:port / start the mesh with `meshserve up` to use its only cloud worker"
        )
    replicas = await cloud_replicas(router, args.internal_token, min(args.timeout, 10.0))
    if len(replicas) == 1:
        return str(replicas[0].address)
    if not replicas:
        raise UsageError(f"router {router} knows no cloud worker; pass --worker host:port")
    choices = ", ".join(f"{r.address} ({r.worker_id or '?'})" for r in replicas)
    raise UsageError(
        f"router {router} knows {len(replicas)} cloud workers: {choices}; pick one with --worker host:port"
    )


async def transfer(
    address: str, action: str, req: worker_pb2.KvPrefixRequest, token: str, timeout_s: float = DEFAULT_TIMEOUT_S
) -> Reply:
    """Call ImportKV (``action`` "import") or ExportKV ("export") on the worker at ``address``."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        call = stub.ImportKV if action == "import" else stub.ExportKV
        reply: Reply = await call(req, metadata=((md.INTERNAL_TOKEN, token),), timeout=timeout_s)
        return reply


def render(address: str, reply: Reply, as_json: bool = False) -> str:
    """One line saying what the call did (or the reply as JSON, with the worker's address)."""
    if as_json:
        data = MessageToDict(reply, always_print_fields_with_no_presence=True)
        return json.dumps({"worker": address, **data}, indent=2)
    blocks = f"{reply.blocks} full block{'' if reply.blocks == 1 else 's'}"
    size = f"{reply.prompt_tokens} prompt tokens, {blocks} of {reply.block_tokens}"
    if isinstance(reply, worker_pb2.KvImportResponse):
        held = reply.blocks_held + reply.blocks_imported
        line = (
            f"{address}: {size}: {reply.blocks_held} already held, {reply.blocks_imported} imported now "
            f"from Redis ({held} of {reply.blocks} held)"
        )
        if reply.redis_unavailable:
            line += "; Redis was unavailable, nothing was read from it"
        return line
    line = f"{address}: {size}: {reply.blocks_written} written to Redis, {reply.blocks_not_held} not held"
    refused = reply.blocks - reply.blocks_not_held - reply.blocks_written
    if refused > 0:
        line += f" ({refused} held but refused by Redis: over its byte budget, or too large)"
    return line


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split())


async def _run(args: argparse.Namespace) -> tuple[int, str]:
    """The exit code and the one line to print (stdout on success, stderr otherwise)."""
    prog = f"meshserve cache {args.action}"
    try:
        req = request(args)
        address = await find_worker(args)
    except UsageError as exc:
        return 2, f"{prog}: {exc}"
    except grpc.aio.AioRpcError as exc:
        return 1, (
            f"{prog}: cannot list the cloud workers of router {cache_where.router_address(args)} "
            f"({exc.code().name}: {_one_line(exc.details())}); pass --worker host:port"
        )
    try:
        reply = await transfer(address, args.action, req, args.internal_token, args.timeout)
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
        hint = f" (no answer in {args.timeout:g} s)" if code == grpc.StatusCode.DEADLINE_EXCEEDED else ""
        return 1, f"{prog}: worker {address}: {code.name}: {_one_line(exc.details())}{hint}"
    return 0, render(address, reply, args.json)


def main(args: argparse.Namespace) -> int:
    """Run ``meshserve cache import|export``: the answer on stdout, or one line on stderr and exit 1
    (a gRPC error, the router's included) or 2 (no worker to call, no tokenizer for ``--chat``)."""
    code, line = asyncio.run(_run(args))
    print(line, file=sys.stderr if code else sys.stdout)
    return code
