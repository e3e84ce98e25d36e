"""The ``meshserve`` command: ``models prepare`` (and ``versions``/``rollout``/``rollback``), ``chat``,
``up``, ``bench``, ``keys``, ``cache``, ``batch``, and the
container entry points ``serve``, ``health`` and ``frontdoor``.

``up`` and ``bench`` hand their arguments to :func:`services.cli.up.main` and
:func:`benchmarks.cli.main`, imported only when used so the other commands start fast.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys
from collections.abc import Sequence

_DELEGATED = {
    "up": ("services.cli.up", "main"),
    "bench": ("benchmarks.cli", "main"),
    "cache": ("services.cli.cache", "main"),
    "status": ("services.cli.status", "main"),
    "serve": ("services.local.launch", "serve_main"),
    "health": ("services.local.launch", "health_main"),
    "frontdoor": ("services.controlplane.server", "main"),
    "batch": ("services.cli.batch", "main"),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshserve", description="LLM inference mesh of gRPC microservices.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    models = commands.add_parser("models", help="manage prepared models").add_subparsers(
        dest="models_command", required=True, metavar="ACTION"
    )
    from services.cli import prepare
    from services.models import evaluate

    prepare.add_arguments(models.add_parser("prepare", help="build the cloud checkpoint, edge model, draft, manifest"))
    evaluate.add_arguments(
        models.add_parser("eval", help="perplexity and greedy agreement of fp32, INT4 and student models")
    )

    from services.cli import rollout

    rollout.add_arguments(models)

    from services.models import distill

    distill.add_arguments(
        commands.add_parser("distill", help="distill the cloud model into a smaller student and export it to INT4")
    )

    from services.common.config import DEFAULT_ADDRESS, ClientSettings

    env = ClientSettings()
    chat = commands.add_parser("chat", help="stream an answer through the gateway")
    chat.add_argument("prompt", help="what to ask")
    chat.add_argument(
        "--address",
        default=env.address,
        help=f"gateway host:port (default: $MESHSERVE_ADDRESS or {DEFAULT_ADDRESS})",
    )
    chat.add_argument(
        "--api-key",
        default=env.api_key,
        help="API key (default: $MESHSERVE_API_KEY, else the local mesh's dev key)",
    )
    chat.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    chat.add_argument(
        "--temperature", type=float, default=None, help="0 = greedy, up to 2 (default: the model's, GET /v1/models)"
    )
    chat.add_argument("--tier", choices=("auto", "edge", "cloud"), default="auto", help="routing hint")
    chat.add_argument("--system", default=None, help="optional system message")

    from services.cli import keys

    keys.add_arguments(commands.add_parser("keys", help="create, list and revoke the gateway's API keys"))

    commands.add_parser("up", help="start the whole mesh locally (see `meshserve up -h`)", add_help=False)
    commands.add_parser(
        "bench", help="benchmarks: mesh overhead, load, soak, gateways, ... (see `meshserve bench -h`)", add_help=False
    )
    commands.add_parser(
        "cache", help="cache stats, flush, warm-up, where, KV import/export (see `meshserve cache -h`)", add_help=False
    )
    commands.add_parser("status", help="live view of the mesh: replicas, load, tokens/s, caches", add_help=False)
    commands.add_parser("serve", help="run one service in the foreground (container entry point)", add_help=False)
    commands.add_parser("health", help="exit 0 if a gRPC service reports SERVING (healthchecks)", add_help=False)
    commands.add_parser("frontdoor", help="run Envoy + the OpenAI HTTP adapter before the gateways", add_help=False)
    commands.add_parser("batch", help="submit, watch, cancel batches and fetch their results", add_help=False)
    return parser


def _delegate(command: str, argv: Sequence[str]) -> int:
    module_name, attr = _DELEGATED[command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module_name.startswith(exc.name):
            raise
        print(f"meshserve {command}: not available in this installation ({module_name} is missing)", file=sys.stderr)
        return 2
    return int(getattr(module, attr)(list(argv)) or 0)


def _chat(args: argparse.Namespace) -> int:
    import grpc

    from services.cli.client import print_stream

    api_key = args.api_key
    if api_key is None:
        try:
            from services.local.mesh import DEV_API_KEY
        except ImportError:
            print("meshserve chat: pass --api-key or set MESHSERVE_API_KEY", file=sys.stderr)
            return 2
        api_key = DEV_API_KEY
    try:
        asyncio.run(
            print_stream(
                args.address,
                api_key,
                args.prompt,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                tier=args.tier,
                system=args.system,
            )
        )
    except grpc.aio.AioRpcError as exc:
        hint = ""
        if exc.code() == grpc.StatusCode.UNAVAILABLE and "failed to connect" in (exc.details() or ""):
            hint = f"; nothing answers at {args.address}: start the mesh (`meshserve up`) or pass --address"
        print(f"\nmeshserve chat: {exc.code().name}: {exc.details()}{hint}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DELEGATED:
        return _delegate(argv[0], argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "keys":
        from services.cli import keys

        return keys.run(args)
    if args.command == "models" and args.models_command in ("versions", "rollout", "rollback"):
        from services.cli import rollout

        return rollout.run(args)
    if args.command == "models":
        from services.cli import prepare
        from services.models import evaluate

        return evaluate.run(args) if args.models_command == "eval" else prepare.run(args)
    if args.command == "distill":
        from services.models import distill

        return distill.run(args)
    return _chat(args)


if __name__ == "__main__":
    sys.exit(main())
