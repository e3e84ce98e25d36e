"""`meshserve up --edge-version NAME=DIR --edge-model ID=DIR` as a real subprocess: the extra workers
serve the second version of the default model and the second model id. Traffic stays on the prepared
build until `meshserve models rollout` (run as a user runs it, finding the router in the state file)
moves it, and then a real request is served by the second version's worker."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import grpc
import pytest

from services.common.config import DEFAULT_INTERNAL_TOKEN
from services.common.model_paths import DEFAULT_MODEL_ID, model_paths
from services.common.pb.meshserve.internal.v1 import router_admin_pb2 as admin_pb
from services.common.pb.meshserve.internal.v1 import router_admin_pb2_grpc
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.pb.meshserve.v1 import inference_pb2_grpc
from services.local.mesh import DEV_API_KEY
from tests.integration.local.test_up import _meshserve, _read_until, _running, _up

pytestmark = pytest.mark.integration
PATHS = model_paths()
ALIAS = "smollm2-alias"


async def _served_by(stub: inference_pb2_grpc.InferenceStub, model: str = "") -> str:
    request = pb.GenerateRequest(prompt="Hello", model=model, sampling=pb.SamplingParams(max_tokens=2, temperature=1.0))
    meta = (("authorization", f"Bearer {DEV_API_KEY}"),)
    frames = [f async for f in stub.Generate(request, metadata=meta, timeout=60)]
    assert frames[-1].HasField("final") and frames[-1].final.usage.completion_tokens >= 1
    return frames[-1].final.route.worker_id


async def test_up_serves_a_second_version_and_a_second_model(tmp_path: Path) -> None:
    argv = ["--edge-workers", "1", "--cloud-workers", "0", "--no-restart"]
    argv += ["--edge-version", f"int8={PATHS.root / 'draft-int8'}", "--edge-model", f"{ALIAS}={PATHS.edge_dir}"]
    state_file = tmp_path / "mesh.json"
    async with _up(tmp_path, *argv) as (proc, marker):
        assert proc.stderr is not None
        await asyncio.wait_for(_read_until(proc.stderr, lambda line: "Ctrl-C stops" in line), 240)
        state = json.loads(state_file.read_text())
        async with (
            grpc.aio.insecure_channel(str(state["gateway"])) as gateway,
            grpc.aio.insecure_channel(str(state["router"])) as router,
        ):
            stub = inference_pb2_grpc.InferenceStub(gateway)
            admin = router_admin_pb2_grpc.RouterAdminStub(router)
            meta = (("x-meshserve-internal-token", DEFAULT_INTERNAL_TOKEN),)
            reply = await admin.ListRollouts(admin_pb.ListRolloutsRequest(), metadata=meta)
            listed = {m.model: m for m in reply.models}
            assert listed.keys() == {DEFAULT_MODEL_ID, ALIAS}
            default = listed[DEFAULT_MODEL_ID]
            assert {w.version: w.weight for w in default.weights} == {"prepared": 100}  # int8 gets none
            assert {v.version: v.healthy_replicas for v in default.versions} == {"prepared": 1, "int8": 1}

            assert await _served_by(stub) == "edge-0"  # all the weight on the prepared build
            assert await _served_by(stub, ALIAS) == f"edge-model-{ALIAS}"
            await _meshserve(state_file, "models", "rollout", DEFAULT_MODEL_ID, "--weights", "prepared=0,int8=100")
            assert {await _served_by(stub) for _ in range(3)} == {"edge-version-int8"}  # the second version
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
        assert _running(marker) == []
