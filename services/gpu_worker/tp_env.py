"""A tensor-parallel rank's environment and the checks made before any weight is loaded: the rank
and world from torchrun's variables, whether a TP degree fits the model's heads, the model's shape,
and the rank's device."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from services.common.errors import ConfigError
from services.gpu_worker.config import TorchrunSettings
from services.gpu_worker.model import LlamaConfig


@dataclass(frozen=True)
class RankEnv:
    """This process's place in its tensor-parallel group (torchrun's environment variables)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RankEnv:
        """From this process's environment (:class:`TorchrunSettings`), or from ``environ`` alone."""
        env = TorchrunSettings() if environ is None else TorchrunSettings.model_validate(dict(environ))
        local_rank = env.rank if env.local_rank is None else env.local_rank
        return cls(rank=env.rank, world=env.world_size, local_rank=local_rank)

    @property
    def leader(self) -> bool:
        return self.rank == 0


def check_degree(config: LlamaConfig, world: int) -> None:
    """ConfigError (one sentence, with the fix) unless ``world`` divides the heads, KV heads and MLP width."""
    kv, heads = config.kv_heads, config.heads
    if kv % world or heads % world or config.intermediate % world:
        fits = [d for d in range(1, kv + 1) if kv % d == 0 and heads % d == 0 and config.intermediate % d == 0]
        raise ConfigError(
            f"tensor-parallel degree {world} must divide the model's {heads} attention heads and {kv} KV heads "
            f"(and its MLP width {config.intermediate}); start one of {fits} ranks (torchrun --nproc-per-node)"
        )


def model_config(path: str, *, allow_download: bool = False) -> LlamaConfig:
    """The model's shape, read from its ``config.json`` (no weights loaded)."""
    return LlamaConfig.from_pretrained(path, allow_download=allow_download)


def device_for(env: RankEnv, device: torch.device) -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` for CUDA (one GPU per rank), else ``device`` unchanged."""
    if device.type == "cuda":
        index = env.local_rank if env.world > 1 else (device.index or 0)
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return device
