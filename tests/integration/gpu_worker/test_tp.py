"""Tensor parallelism with real processes: 3 gloo ranks on 127.0.0.1 give TP=1's greedy tokens.

Two levels: the model (``tp_rank.py`` ranks driving ``LeaderModel``/``follow`` directly) and the
worker as deployed (``torchrun ... -m services.gpu_worker``: rank 0 serves gRPC, the others follow).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import pytest
import torch
from tokenizers import Tokenizer

from services.common.errors import ConfigError
from services.common.pb.meshserve.internal.v1 import worker_pb2_grpc
from services.gpu_worker.model import LlamaModel
from services.gpu_worker.tp import RankEnv, check_degree, load_model, model_config
from services.models.paths import model_paths
from services.processes import ServiceProcess
from tests.helpers import free_port
from tests.integration.gpu_worker.greedy import greedy
from tests.worker_helpers import generate, wait_serving

pytestmark = pytest.mark.integration
MODEL = str(model_paths().hf_dir)
QUESTIONS = ["Name three colours.", "What is the capital of France?"]
MAX_TOKENS = 8
EOS = 2  # SmolLM2's <|im_end|>


def _prompts() -> list[list[int]]:
    tokenizer = Tokenizer.from_file(str(model_paths().hf_dir / "tokenizer.json"))
    chat = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    return [list(tokenizer.encode(chat.format(q)).ids) for q in QUESTIONS]


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def single() -> list[list[int]]:
    """TP=1 greedy tokens of PROMPTS: the reference."""
    torch.set_num_threads(1)
    model = LlamaModel.load(MODEL, device=torch.device("cpu"), dtype=torch.float32)
    return [greedy(model, p, MAX_TOKENS) for p in PROMPTS]


def _run_group(world: int, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME="lo",
        )
        argv = [sys.executable, "-m", "tests.integration.gpu_worker.tp_rank", MODEL, str(max_tokens)]
        argv += [",".join(map(str, p)) for p in prompts]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, err[-2000:]
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    line = next(line for line in outs[0].splitlines() if line.startswith('{"tokens"'))
    return json.loads(line)["tokens"]


def test_tp3_greedy_equals_tp1(single: list[list[int]]) -> None:
    assert _run_group(3, PROMPTS, MAX_TOKENS) == single
    assert all(len(s) == MAX_TOKENS for s in single)


async def test_tp3_worker_under_torchrun_serves_tp1_greedy_over_grpc(single: list[list[int]]) -> None:
    lines: list[str] = []
    env = dict(
        os.environ,
        MESHSERVE_GPU_WORKER_HOST="127.0.0.1",
        MESHSERVE_GPU_WORKER_PORT="0",
        MESHSERVE_GPU_WORKER_THREADS="1",
        MESHSERVE_GPU_WORKER_DEVICE="cpu",
        MESHSERVE_GPU_WORKER_KV_DTYPE="float32",  # the reference keeps float32 KV
        MESHSERVE_GPU_WORKER_KV_BUDGET_BYTES=str(32 << 20),
        MESHSERVE_GPU_WORKER_WORKER_ID="cloud-tp3",
        GLOO_SOCKET_IFNAME="lo",
    )
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=3"]
    proc = ServiceProcess("cloud-tp3", [*argv, "-m", "services.gpu_worker"], env, lambda _n, line: lines.append(line))
    await proc.spawn()
    try:
        await proc.wait_started(240)
        async with grpc.aio.insecure_channel(proc.address) as channel:
            await wait_serving(channel, "meshserve.internal.v1.Worker", timeout_s=120)
            stub = worker_pb2_grpc.WorkerStub(channel)
            for prompt, expected in zip(PROMPTS, single, strict=True):
                result = await generate(stub, prompt, max_tokens=MAX_TOKENS)
                expected = expected[: expected.index(EOS)] if EOS in expected else expected  # not streamed
                assert result.token_ids == expected, "\n".join(lines[-20:])
    finally:
        await proc.stop(60)
    assert proc.proc is not None and proc.proc.returncode is not None
    assert any('"tp_follower_stopped"' in line for line in lines)  # followers left on rank 0's stop


def test_tp2_is_refused_naming_the_head_counts() -> None:
    config = model_config(MODEL)
    with pytest.raises(ConfigError) as err:
        check_degree(config, 2)
    message = str(err.value)
    assert "9 attention heads" in message and "3 KV heads" in message and "[1, 3]" in message
    check_degree(config, 3)
    with pytest.raises(ConfigError, match="tensor-parallel degree 2"):  # before any process group forms
        load_model(MODEL, device=torch.device("cpu"), dtype=torch.float32, env=RankEnv(rank=0, world=2))
