"""The A/B launcher's mesh from another source tree: real processes running that tree's code, serving."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from benchmarks.gateway.tree_mesh import start_mesh
from services.cli.client import MeshClient, sampling_params
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.local.mesh import DEV_API_KEY

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[3]


def _proc(pid: int, what: str) -> list[bytes]:
    """/proc/<pid>/<what> (cmdline, environ) split at its NULs."""
    return Path(f"/proc/{pid}/{what}").read_bytes().split(b"\0")


async def test_a_mesh_from_another_tree_runs_that_trees_modules_and_serves() -> None:
    with tempfile.TemporaryDirectory(prefix="meshserve-tree-mesh-") as tmp:
        mesh = await start_mesh(tmp, ROOT, layouts=("embedded",), suffix="_b")
        try:
            assert set(mesh.procs) == {"redis_b", "worker_b", "gateway_embedded_b"} and not mesh.notes
            for name, module in (
                ("worker_b", "benchmarks.gateway.instant_worker"),
                ("gateway_embedded_b", "services.gateway"),
            ):
                pid = mesh.pids()[name]
                argv = _proc(pid, "cmdline")
                assert argv[1:4] == [b"-P", b"-m", module.encode()]  # the current directory stays off the path
                assert f"PYTHONPATH={ROOT}".encode() in _proc(pid, "environ")
            request = pb.GenerateRequest(
                prompt="Say something.",
                sampling=sampling_params(max_tokens=4, temperature=0.0),
                routing=pb.RoutingOptions(cache_policy=pb.CACHE_POLICY_BYPASS),
            )
            async with MeshClient(mesh.procs["gateway_embedded_b"].address, DEV_API_KEY) as client:
                tokens = [
                    t
                    async for frame in client.stub.Generate(request, metadata=client.metadata)
                    for t in frame.token_ids
                ]
            assert len(tokens) == 4
        finally:
            await mesh.stop()
