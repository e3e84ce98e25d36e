"""`meshserve models versions | rollout | rollback`: a router's served models and their rollouts.

Talks to the router's ``RouterAdmin`` (internal credential): ``ListRollouts``, ``SetRollout``,
``Rollback``. The change applies at once, with no restart: requests in flight keep the version they
drew. The router address defaults to the one ``meshserve up`` records (its state file).

    meshserve models versions
    meshserve models rollout smollm2-135m-instruct --weights v1=95,v2=5 --shadow v3 --sticky tenant
    meshserve models rollout smollm2-135m-instruct --auto-rollback ttft_ms=300,error_rate=0.05,window_s=60
    meshserve models rollback smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import grpc

from services.common import metadata as md
from services.common.config import ClientSettings
from services.common.errors import InvalidArgument
from services.common.pb.meshserve.internal.v1 import router_admin_pb2, router_admin_pb2_grpc
from services.local.state import read_state, state_path
from services.router.frontend.rollout import parse_weights

_RULE_KEYS = {"error_rate": "error_rate_margin", "ttft_ms": "ttft_p99_margin_ms", "window_s": "window_s"}


def add_arguments(models: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``versions``, ``rollout`` and ``rollback`` to the ``meshserve models`` actions."""

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--router", default="", help="router host:port (default: from `meshserve up`'s state file)")
        p.add_argument(
            "--internal-token",
            default=ClientSettings().internal_token,
            help="the mesh's internal credential (default: $MESHSERVE_INTERNAL_TOKEN or the dev token)",
        )

    versions = models.add_parser("versions", help="the router's served models, versions and rollouts")
    versions.add_argument("model", nargs="?", default="", help="one model (default: all)")
    common(versions)
    rollout = models.add_parser("rollout", help="change a model's rollout at run time (weights, shadow, ...)")
    rollout.add_argument("model", help="the model id")
    rollout.add_argument("--weights", default="", help="version=weight pairs, e.g. v1=95,v2=5 (replace all)")
    rollout.add_argument("--shadow", default=None, help="version that gets a discarded copy of each Generate")
    rollout.add_argument("--no-shadow", action="store_true", help="stop shadowing")
    rollout.add_argument("--sticky", choices=("chat", "tenant"), default=None, help="what keeps one version")
    rollout.add_argument(
        "--auto-rollback",
        default=None,
        metavar="RULE",
        help="roll a canary back automatically: error_rate=0.05,ttft_ms=500,window_s=60,min_samples=50",
    )
    rollout.add_argument("--no-auto-rollback", action="store_true", help="turn automatic rollback off")
    common(rollout)
    rollback = models.add_parser("rollback", help="all of a model's traffic back to its primary version")
    rollback.add_argument("model", help="the model id")
    common(rollback)


def parse_rule(text: str) -> router_admin_pb2.RollbackRule:
    """``error_rate=0.05,ttft_ms=500,window_s=60,min_samples=50`` (any subset; defaults for the rest)."""
    rule = router_admin_pb2.RollbackRule(error_rate_margin=0.05, ttft_p99_margin_ms=500, window_s=60, min_samples=50)
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        try:
            if key == "min_samples":
                rule.min_samples = int(value)
            elif key in _RULE_KEYS:
                setattr(rule, _RULE_KEYS[key], float(value))
            else:
                raise ValueError
        except ValueError:
            raise InvalidArgument(
                f"{part!r} must be key=number with key error_rate, ttft_ms, window_s or min_samples"
            ) from None
    return rule


def request_of(args: argparse.Namespace) -> router_admin_pb2.SetRolloutRequest:
    """The SetRollout request the ``rollout`` arguments ask for."""
    req = router_admin_pb2.SetRolloutRequest(model=args.model)
    if args.weights:
        for version, weight in parse_weights(args.weights).items():
            req.weights.append(router_admin_pb2.VersionWeight(version=version, weight=weight))
    if args.no_shadow:
        req.shadow = ""
    elif args.shadow is not None:
        req.shadow = args.shadow
    if args.sticky is not None:
        req.sticky = args.sticky
    if args.no_auto_rollback:
        req.clear_rollback = True
    elif args.auto_rollback is not None:
        req.rollback.CopyFrom(parse_rule(args.auto_rollback))
    return req


def describe(m: router_admin_pb2.ModelRollout) -> str:
    """A model's rollout in a few lines (also `meshserve status`)."""
    weights = ", ".join(f"{w.version}={w.weight}" for w in m.weights)
    head = f"{m.model}{' (default)' if m.is_default else ''}: {weights}; primary {m.primary}; sticky {m.sticky}"
    if m.shadow:
        head += f"; shadow {m.shadow}"
    if m.HasField("rollback"):
        r = m.rollback
        head += (
            f"; auto-rollback error_rate+{r.error_rate_margin:g} ttft_p99+{r.ttft_p99_margin_ms:g}ms"
            f" over {r.window_s:g}s (min {r.min_samples})"
        )
    if m.policy_store and m.policy_store != "local":  # shared by the router replicas through Redis
        store = {"unreachable": "Redis unreachable: last known", "pending": "rollback not shared yet"}
        head += f"; policy epoch {m.policy_epoch} ({store.get(m.policy_store, m.policy_store)})"
    lines = [head]
    for v in m.versions:
        line = f"  {v.version:<12} build {v.build[:16]:<16} replicas {v.healthy_replicas}  requests {v.requests}"
        line += f"  errors {v.errors}"
        if v.window_samples:
            line += f"  window: {v.window_samples} samples, error rate {v.window_error_rate:.3f}"
            line += f", ttft p99 {v.window_ttft_p99_ms:.0f} ms"
        if v.shadow_requests or v.shadow_shed:
            agree = f"{v.shadow_agreed}/{v.shadow_compared} agreed" if v.shadow_compared else "none compared"
            line += f"  shadow {v.shadow_requests} ({agree}, {v.shadow_shed} shed)"
        lines.append(line)
    lines += [f"  rolled back {e.version} -> {e.to} {e.age_s:.0f}s ago: {e.reason}" for e in m.rollbacks]
    return "\n".join(lines)


async def _call(args: argparse.Namespace, router: str) -> list[router_admin_pb2.ModelRollout]:
    meta = ((md.INTERNAL_TOKEN, args.internal_token),)
    async with grpc.aio.insecure_channel(router) as channel:
        stub = router_admin_pb2_grpc.RouterAdminStub(channel)
        if args.models_command == "rollout":
            return [await stub.SetRollout(request_of(args), metadata=meta, timeout=5.0)]
        if args.models_command == "rollback":
            return [await stub.Rollback(router_admin_pb2.RollbackRequest(model=args.model), metadata=meta, timeout=5.0)]
        asked = router_admin_pb2.ListRolloutsRequest(model=args.model)
        reply = await stub.ListRollouts(asked, metadata=meta, timeout=5.0)
        return list(reply.models)


def run(args: argparse.Namespace) -> int:
    router = args.router or str(read_state().get("router", ""))
    if not router:
        print(f"meshserve models: no router address; pass --router host:port or start `meshserve up` ({state_path()})")
        return 2
    try:
        for model in asyncio.run(_call(args, router)):
            print(describe(model))
    except InvalidArgument as exc:
        print(f"meshserve models {args.models_command}: {exc.message}", file=sys.stderr)
        return 2
    except grpc.aio.AioRpcError as exc:
        print(f"meshserve models {args.models_command}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    return 0
