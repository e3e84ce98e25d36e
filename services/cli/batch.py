"""``meshserve batch submit|status|cancel|results``: the Batch API from the command line, over the
gateway's gRPC ``meshserve.v1.Batches`` service (the same calls the OpenAI HTTP routes make).

``submit FILE`` uploads a JSONL file of requests and creates a batch (``--wait``: shows a progress bar
until it ends); ``status ID`` prints it (``--wait`` likewise); ``cancel ID``; ``results ID`` prints the
output file (``--errors``: the error file) or writes it with ``-o``. The gateway address and API key:
``--address``/``--api-key``, else ``$MESHSERVE_ADDRESS``/``$MESHSERVE_API_KEY``, else the mesh
``meshserve up`` runs and its development key.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
from tqdm import tqdm

from services.common.config import DEFAULT_ADDRESS, ClientSettings
from services.common.pb.meshserve.v1 import batch_pb2 as pb
from services.common.pb.meshserve.v1 import batch_pb2_grpc
from services.local.state import recorded

TERMINAL = ("completed", "failed", "expired", "cancelled")
POLL_S = 0.5


def _parser() -> argparse.ArgumentParser:
    env = ClientSettings()
    parser = argparse.ArgumentParser(prog="meshserve batch", description="Run OpenAI-style batches on the mesh.")
    parser.add_argument(
        "--address",
        default=None,
        help=f"gateway host:port (default: $MESHSERVE_ADDRESS, else the running mesh's, else {DEFAULT_ADDRESS})",
    )
    parser.add_argument(
        "--api-key", default=env.api_key, help="API key (default: $MESHSERVE_API_KEY, else the local mesh's dev key)"
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    submit = actions.add_parser("submit", help="upload a JSONL file of requests and create a batch")
    submit.add_argument("file", type=Path, help="JSONL: {custom_id, method: POST, url, body} per line")
    submit.add_argument(
        "--endpoint",
        default="/v1/chat/completions",
        choices=("/v1/chat/completions", "/v1/completions"),
        help="the url of every line (default /v1/chat/completions)",
    )
    submit.add_argument("--window", default="24h", help="completion window, e.g. 24h or 90m (default 24h)")
    submit.add_argument("--wait", action="store_true", help="show progress until the batch ends")
    status = actions.add_parser("status", help="show a batch")
    status.add_argument("batch_id")
    status.add_argument("--wait", action="store_true", help="show progress until the batch ends")
    cancel = actions.add_parser("cancel", help="cancel a batch (lines already running finish)")
    cancel.add_argument("batch_id")
    results = actions.add_parser("results", help="print or save a finished batch's output file")
    results.add_argument("batch_id")
    results.add_argument("--errors", action="store_true", help="the error file instead")
    results.add_argument("-o", "--output", type=Path, default=None, help="write to this file instead of stdout")
    return parser


def _describe(b: pb.BatchObject) -> str:
    c = b.request_counts
    files = "".join(
        f" {name}={value}" for name, value in (("output", b.output_file_id), ("errors", b.error_file_id)) if value
    )
    return f"{b.id} {b.status}: {c.completed}/{c.total} completed, {c.failed} failed{files}"


async def _progress(
    stub: batch_pb2_grpc.BatchesStub, metadata: Sequence[tuple[str, str]], batch: pb.BatchObject
) -> pb.BatchObject:
    """Poll ``batch`` with a progress bar (on stderr) until it ends."""
    with tqdm(total=batch.request_counts.total, unit="line", file=sys.stderr, desc=batch.id) as bar:
        while True:
            c = batch.request_counts
            bar.update(c.completed + c.failed - bar.n)
            bar.set_postfix_str(f"{batch.status}, {c.failed} failed")
            if batch.status in TERMINAL:
                return batch
            await asyncio.sleep(POLL_S)
            batch = await stub.GetBatch(pb.BatchRef(batch_id=batch.id), metadata=metadata, timeout=30)


async def _run(args: argparse.Namespace) -> int:
    address = args.address or ClientSettings().address
    if args.address is None and address == DEFAULT_ADDRESS:
        address = recorded("gateway") or address
    api_key = args.api_key
    if api_key is None:
        from services.local.mesh import DEV_API_KEY

        api_key = DEV_API_KEY
    metadata = (("authorization", f"Bearer {api_key}"),)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = batch_pb2_grpc.BatchesStub(channel)
        if args.action == "submit":
            try:
                content = args.file.read_bytes()
            except OSError as exc:
                print(f"meshserve batch: cannot read {args.file}: {exc.strerror}", file=sys.stderr)
                return 2
            upload = await stub.CreateFile(
                pb.CreateFileRequest(filename=args.file.name, purpose="batch", content=content), metadata=metadata
            )
            batch = await stub.CreateBatch(
                pb.CreateBatchRequest(input_file_id=upload.id, endpoint=args.endpoint, completion_window=args.window),
                metadata=metadata,
            )
            print(batch.id)
        elif args.action == "cancel":
            batch = await stub.CancelBatch(pb.BatchRef(batch_id=args.batch_id), metadata=metadata)
        else:
            batch = await stub.GetBatch(pb.BatchRef(batch_id=args.batch_id), metadata=metadata)
        if args.action == "results":
            file_id = batch.error_file_id if args.errors else batch.output_file_id
            if not file_id:
                what = "error" if args.errors else "output"
                print(f"meshserve batch: {_describe(batch)}; it has no {what} file (yet)", file=sys.stderr)
                return 1
            call = stub.GetFileContent(pb.FileRef(file_id=file_id), metadata=metadata)
            content = b"".join([piece.content async for piece in call])
            if args.output is not None:
                args.output.write_bytes(content)
            else:
                sys.stdout.buffer.write(content)
            return 0
        if getattr(args, "wait", False):
            batch = await _progress(stub, metadata, batch)
        print(_describe(batch), file=sys.stderr if args.action == "submit" else sys.stdout)
    return 0


def main(argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    try:
        return asyncio.run(_run(args))
    except grpc.aio.AioRpcError as exc:
        print(f"meshserve batch: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
