"""The cloud model's fused-weight cache (weights_cache.py): a hit maps the file and gives the same
logits; a stale, corrupt or truncated file is rebuilt; an unwritable directory is not fatal."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM

from services.gpu_worker import weights_cache
from services.gpu_worker.model import LlamaModel
from services.gpu_worker.plan import Segment

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = HFLlamaConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=128, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    directory = tmp_path_factory.mktemp("hf")
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def _logits(model: LlamaModel) -> torch.Tensor:
    cache = model.new_cache(4, 16, torch.float32)
    (logits,) = model.forward([Segment(token_ids=[1, 5, 9, 3], start=0, block_table=[0])], cache)
    return logits


def _load(checkpoint: Path, cache_dir: Path | None) -> LlamaModel:
    return LlamaModel.load(str(checkpoint), device=CPU, dtype=torch.float32, cache_dir=cache_dir)


def test_a_hit_maps_the_file_and_gives_the_same_logits(checkpoint: Path, tmp_path: Path) -> None:
    plain = _logits(_load(checkpoint, None))
    first = _load(checkpoint, tmp_path)
    assert first.fused_built
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
    again = _load(checkpoint, tmp_path)
    assert not again.fused_built  # every fused weight came from the file
    assert torch.equal(_logits(first), plain) and torch.equal(_logits(again), plain)


def test_a_stale_or_corrupt_file_is_rebuilt(checkpoint: Path, tmp_path: Path) -> None:
    plain = _logits(_load(checkpoint, None))
    _load(checkpoint, tmp_path)
    (entry,) = tmp_path.glob("*.safetensors")
    stale = weights_cache.read(entry)
    assert stale is not None
    stale = {k: v.clone() for k, v in stale.items()}
    stale["model.layers.1.qkv"][3, 7] += 1.0  # one weight off: the file no longer equals the checkpoint
    # Replaced, not written in place: a file mapped by a live model must not change under it (SIGBUS),
    # which is why weights_cache.write renames a new file into place.
    save_file(stale, str(tmp_path / "new"))
    (tmp_path / "new").replace(entry)
    rebuilt = _load(checkpoint, tmp_path)
    assert rebuilt.fused_built and torch.equal(_logits(rebuilt), plain)
    assert not _load(checkpoint, tmp_path).fused_built  # written again, right
    (tmp_path / "new").write_bytes(entry.read_bytes()[:1000])  # truncated
    (tmp_path / "new").replace(entry)
    truncated = _load(checkpoint, tmp_path)
    assert truncated.fused_built and torch.equal(_logits(truncated), plain)


def test_an_unwritable_directory_is_not_fatal(checkpoint: Path, tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    model = _load(checkpoint, blocked / "cache")
    assert model.fused_built and _logits(model).shape == (1, 128)
