"""The cloud model's config read from config.json without transformers (model.py) equals transformers'."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from transformers import LlamaConfig as HFLlamaConfig

from services.common.model_paths import model_paths
from services.gpu_worker.engine import _eos_ids
from services.gpu_worker.model import LlamaConfig, _zeros

SMOLLM2 = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 9.999999747378752e-06,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "tie_word_embeddings": True,
    "vocab_size": 49152,
}


@pytest.mark.parametrize(
    "config",
    [
        SMOLLM2,
        {**{k: v for k, v in SMOLLM2.items() if k != "rope_parameters"}, "rope_theta": 10000.0, "rope_scaling": None},
        {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 2},
        {**SMOLLM2, "head_dim": None, "num_key_value_heads": None, "tie_word_embeddings": False},
    ],
    ids=["smollm2", "old-rope-keys", "defaults", "nulls"],
)
def test_config_json_equals_transformers(config: dict[str, Any]) -> None:
    hf = HFLlamaConfig(**{k: v for k, v in config.items() if k != "model_type"})
    assert LlamaConfig.from_config_json(config) == LlamaConfig.from_hf(hf)


@pytest.mark.parametrize(
    "config",
    [
        {**SMOLLM2, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0}},
        {**SMOLLM2, "model_type": "mistral"},
        {**SMOLLM2, "attention_bias": True},
    ],
    ids=["scaled-rope", "mistral", "bias"],
)
def test_anything_else_is_left_to_transformers(config: dict[str, Any]) -> None:
    assert LlamaConfig.from_config_json(config) is None


def test_the_prepared_model_reads_the_same_both_ways() -> None:
    directory = model_paths().hf_dir
    if not (directory / "config.json").is_file():
        pytest.skip("no prepared model (meshserve models prepare)")
    from transformers import AutoConfig, GenerationConfig

    fast = LlamaConfig.from_pretrained(str(directory))
    assert fast == LlamaConfig.from_hf(AutoConfig.from_pretrained(str(directory), local_files_only=True))
    assert LlamaConfig.from_config_json(json.loads((directory / "config.json").read_text())) is not None
    eos = GenerationConfig.from_pretrained(str(directory), local_files_only=True).eos_token_id
    assert _eos_ids(str(directory), False) == {eos} | {AutoConfig.from_pretrained(str(directory)).eos_token_id}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_kv_cache_starts_zeroed_and_writable(dtype: torch.dtype) -> None:
    t = _zeros((64, 3, 8), dtype, torch.device("cpu"))
    assert t.shape == (64, 3, 8) and t.dtype == dtype and t.is_contiguous()
    assert not t.any()
    t[5].fill_(1.5)
    assert t.sum().item() == 1.5 * 24
