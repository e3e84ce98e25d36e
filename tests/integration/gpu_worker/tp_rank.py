"""One rank of a tensor-parallel greedy run (``python -m tests.integration.gpu_worker.tp_rank MODEL N PROMPT...``).

Started once per rank with torchrun's environment variables by ``test_tp.py``; rank 0 prints one
JSON line ``{"tokens": [[...], ...]}`` (greedy continuations of the prompts' token ids, comma
separated), the followers mirror its calls through ``services.gpu_worker.tp``.
"""

from __future__ import annotations

import json
import sys

import torch

from services.gpu_worker.tp import LeaderModel, RankEnv, follow, load_model
from tests.integration.gpu_worker.greedy import greedy


def main() -> None:
    torch.set_num_threads(1)
    path, max_tokens, prompts = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    env = RankEnv.from_env()
    model, group = load_model(path, device=torch.device("cpu"), dtype=torch.float32, env=env, timeout_s=60)
    if not env.leader:
        assert group is not None
        follow(model, group)  # type: ignore[arg-type]
        group.close()
        return
    out = [greedy(model, [int(t) for t in p.split(",")], max_tokens) for p in prompts]
    print(json.dumps({"tokens": out}), flush=True)
    if isinstance(model, LeaderModel):
        model.close()


if __name__ == "__main__":
    main()
