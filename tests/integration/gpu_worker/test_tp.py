"""Tensor parallelism with real processes: 3 gloo ranks on 127.0.0.1 give TP=1's greedy tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from services.common.errors import ConfigError
from services.gpu_worker.model import LlamaModel
from services.gpu_worker.tp import RankEnv, check_degree, load_model, model_config
from services.models.paths import model_paths
from tests.helpers import free_port
from tests.integration.gpu_worker.greedy import greedy

MODEL = str(model_paths().hf_dir)
PROMPTS = [
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3437, 28, 7018, 411, 407, 19712, 8182, 2, 198],
    [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
]
MAX_TOKENS = 12


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


def test_tp3_greedy_equals_tp1() -> None:
    torch.set_num_threads(1)
    model = LlamaModel.load(MODEL, device=torch.device("cpu"), dtype=torch.float32)
    single = [greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    assert _run_group(3, PROMPTS, MAX_TOKENS) == single
    assert all(len(s) == MAX_TOKENS for s in single)


def test_tp2_is_refused_naming_the_head_counts() -> None:
    config = model_config(MODEL)
    with pytest.raises(ConfigError) as err:
        check_degree(config, 2)
    message = str(err.value)
    assert "9 attention heads" in message and "3 KV heads" in message and "[1, 3]" in message
    check_degree(config, 3)
    with pytest.raises(ConfigError, match="tensor-parallel degree 2"):  # before any process group forms
        load_model(MODEL, device=torch.device("cpu"), dtype=torch.float32, env=RankEnv(rank=0, world=2))
