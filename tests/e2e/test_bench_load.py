"""`meshserve bench load` against the real mesh: a few bounded requests over gRPC and to a worker directly."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from benchmarks.load import bench as loadbench
from benchmarks.load.generator import Workload, make_items
from benchmarks.load.senders import grpc_sender
from services.cli.client import MeshClient
from services.local.mesh import DEV_API_KEY, Mesh


def _args(mesh: Mesh, out: Path) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    loadbench.add_arguments(parser)
    argv = ["--address", mesh.gateway_address, "--worker-address", mesh.workers("edge")[0].address]
    argv += ["--concurrency", "1,2", "--requests", "4", "--duration", "30", "--max-tokens", "4", "--warmup", "1"]
    argv += ["--mix", "short=0.7,chat=0.3", "--name", "e2e", "--out", str(out), "--quiet"]
    args = parser.parse_args(argv)
    args.argv, args.baselines = argv, ["direct"]
    return args


async def test_load_run_through_the_mesh_and_direct(mesh: Mesh, tmp_path: Path) -> None:
    report = await loadbench.run(_args(mesh, tmp_path))
    assert set(report["targets"]) == {"mesh_grpc", "direct_worker"}
    for target, steps in report["targets"].items():
        assert [s["load"] for s in steps] == [1, 2]
        for step in steps:
            s = step["summary"]
            assert s["requests"] == 4 and s["ok"] == 4 and s["errors"] == {}
            assert s["tokens"] > 0 and s["ttft_ms_p50"] > 0 and s["e2e_ms_p99"] >= s["e2e_ms_p50"]
            if target == "direct_worker":
                assert s["routes"] == {"direct": 4}
            else:  # every route names a tier and worker of this mesh (no cache: prompts are unique)
                assert all(r.split("/")[0] in ("edge", "cloud") for r in s["routes"])
    written = loadbench.write(report, tmp_path)
    assert {p.name for p in written} == {"e2e.json", "e2e.md", "e2e_e2e.png", "e2e_ttft.png", "e2e_throughput.png"}
    assert json.loads((tmp_path / "e2e.json").read_text())["targets"]["mesh_grpc"][0]["summary"]["ok"] == 4


async def test_a_repeated_greedy_prompt_is_counted_as_a_cache_hit(mesh: Mesh) -> None:
    item = next(i for i in make_items(Workload(cache_hit_ratio=1.0, max_tokens=4), 5, random.Random(2)))
    async with MeshClient(mesh.gateway_address, DEV_API_KEY) as client:
        send = grpc_sender(client)
        first, second = await send(item), await send(item)
    assert first.status == second.status == "OK"
    assert second.route == "cache" and second.tokens == first.tokens
