"""Tensor-parallel plumbing with fakes: torchrun env, degree check, the follower loop, the mesh launcher."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.distributed.run as torchrun

from services.common.errors import ConfigError
from services.gpu_worker.model import KVCache, LlamaConfig
from services.gpu_worker.plan import Segment
from services.gpu_worker.tp import RankEnv, check_degree, follow
from services.local.mesh import torchrun_launcher, tp_env


def config(heads: int = 9, kv: int = 3, mlp: int = 1536) -> LlamaConfig:
    return LlamaConfig(576, 30, heads, kv, 64, mlp, 49152, 1e-5, 2048, True, (1.0,))


def test_rank_env_reads_torchrun_variables() -> None:
    assert RankEnv.from_env({}) == RankEnv(0, 1, 0)
    env = RankEnv.from_env({"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "1"})
    assert (env.rank, env.world, env.local_rank, env.leader) == (2, 3, 1, False)
    assert RankEnv.from_env({"RANK": "2", "WORLD_SIZE": "3"}).local_rank == 2  # LOCAL_RANK unset: the rank


def test_rank_env_reads_this_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert RankEnv.from_env() == RankEnv(0, 1, 0)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert RankEnv.from_env() == RankEnv(1, 3, 1)


def test_degree_must_divide_heads_kv_heads_and_mlp() -> None:
    check_degree(config(), 1)
    check_degree(config(), 3)
    with pytest.raises(ConfigError, match=r"9 attention heads and 3 KV heads.*one of \[1, 3\]"):
        check_degree(config(), 2)
    with pytest.raises(ConfigError, match="MLP width 1537"):
        check_degree(config(mlp=1537), 3)
    with pytest.raises(ConfigError, match="tensor-parallel degree 4"):
        check_degree(config(heads=8, kv=2, mlp=1024), 4)


class FakeGroup:
    def __init__(self, messages: Sequence[tuple[Any, ...]]) -> None:
        self.messages = list(messages)

    def receive(self) -> tuple[Any, ...]:
        return self.messages.pop(0)


class FakeModel:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def new_cache(self, num_blocks: int, block_tokens: int, dtype: torch.dtype) -> str:
        self.calls.append(("new_cache", (num_blocks, block_tokens, dtype)))
        return f"cache{len(self.calls)}"

    def forward(self, segments: Sequence[Segment], cache: str) -> list[torch.Tensor]:
        self.calls.append(("forward", ([(list(s.token_ids), s.start, s.all_logits) for s in segments], cache)))
        if segments[0].start < 0:
            raise ValueError("bad plan")
        return []


def test_follower_mirrors_the_leaders_calls_in_order_until_stop() -> None:
    model = FakeModel()
    group = FakeGroup(
        [
            ("new_cache", 0, 8, 16, "float16"),
            ("ping",),
            ("forward", 0, [([1, 2, 3], 0, [0], False)]),
            ("forward", 0, [([4], -1, [0], False)]),  # fails on the leader too: skipped
            ("forward", 0, [([5, 6], 3, [0], True), ([7], 0, [1], False)]),
            ("free_cache", 0),
            ("stop",),
            ("forward", 0, []),  # never read
        ]
    )
    follow(model, group)  # type: ignore[arg-type]
    assert model.calls == [
        ("new_cache", (8, 16, torch.float16)),
        ("forward", ([([1, 2, 3], 0, False)], "cache1")),
        ("forward", ([([4], -1, False)], "cache1")),
        ("forward", ([([5, 6], 3, True), ([7], 0, False)], "cache1")),
    ]
    assert group.messages == [("forward", 0, [])]


def test_follower_fails_on_an_unknown_call() -> None:
    with pytest.raises(RuntimeError, match="unknown tensor-parallel call"):
        follow(FakeModel(), FakeGroup([("teleport",)]))  # type: ignore[arg-type]


def test_mesh_launches_tp_groups_with_deploys_torchrun_flags() -> None:
    assert torchrun_launcher(1) == [] and tp_env(1) == {}
    argv = torchrun_launcher(3)
    assert argv[0] == "torch.distributed.run"
    args = torchrun.get_args_parser().parse_args([*argv[1:], "services.gpu_worker"])
    assert (args.standalone, args.nnodes, args.nproc_per_node, args.module) == (True, "1", "3", True)
    assert args.training_script == "services.gpu_worker"


class CacheModel:
    """A follower's model whose caches are real (1 layer, 1 KV head of 2 dims, blocks of 2 tokens)."""

    def new_cache(self, num_blocks: int, block_tokens: int, dtype: torch.dtype) -> KVCache:
        shape = (num_blocks * block_tokens, 1, 2)
        k, v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        return KVCache(k=[k], v=[v], block_tokens=block_tokens)


class KVGroup(FakeGroup):
    """Rank 1 of 3: what it gathers is recorded; what it is scattered is ``inbox``."""

    env = RankEnv(rank=1, world=3)

    def __init__(self, messages: Sequence[tuple[Any, ...]], inbox: torch.Tensor) -> None:
        super().__init__(messages)
        self.inbox = inbox
        self.gathered: list[torch.Tensor] = []

    def gather(self, t: torch.Tensor) -> None:
        self.gathered.append(t.clone())

    def scatter(self, out: torch.Tensor, parts: list[torch.Tensor] | None) -> None:
        assert parts is None
        out.copy_(self.inbox)


def test_follower_writes_scattered_kv_slices_and_gathers_them_back_in_call_order() -> None:
    block = torch.arange(8, dtype=torch.float16).view(1, 1, 2, 1, 2, 2)  # [n, layers, 2, local kv, bt, d]
    group = KVGroup(
        [
            ("new_cache", 0, 4, 2, "float16"),
            ("gather_kv", 0, [2]),  # before the write: zeros
            ("scatter_kv", 0, [2]),
            ("gather_kv", 0, [2, 0]),
            ("stop",),
        ],
        block.view(torch.uint8),
    )
    follow(CacheModel(), group)  # type: ignore[arg-type]
    first, second = (t.view(torch.float16) for t in group.gathered)
    assert not first.any()
    assert torch.equal(second[0], block[0]) and not second[1].any()
