"""Random-weight Llama checkpoints in named shapes, with SmolLM2's vocabulary and tokenizer.

Speed and memory do not depend on weight values, so a benchmark that needs a model larger than the
default one (the cloud tier on a GPU, a sleeping edge worker of a larger model) builds one here
instead of downloading it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported by build_checkpoint only: the shapes and counts need none
    import torch

SHAPES: dict[str, dict[str, Any]] = {
    "135m": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3
    ),
    "360m": dict(
        hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5
    ),
    "1b": dict(  # Llama-3.2-1B's layers
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8
    ),
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
}
"""SmolLM2-135M's and -360M's shapes, Llama-3.2-1B's, and a 2-layer one for smoke tests."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def parameters(shape: str, vocab: int = 49152) -> int:
    """The parameter count of ``shape`` with tied embeddings (what ``build_checkpoint`` saves)."""
    s = SHAPES[shape]
    hidden, layers = s["hidden_size"], s["num_hidden_layers"]
    head = hidden // s["num_attention_heads"]
    attention = hidden * hidden * 2 + hidden * head * s["num_key_value_heads"] * 2
    mlp = 3 * hidden * s["intermediate_size"]
    return vocab * hidden + layers * (attention + mlp + 2 * hidden) + hidden


def build_checkpoint(
    shape: str,
    tokenizer_dir: Path,
    out: Path,
    device: torch.device,
    dtype: torch.dtype,
    *,
    stops: bool = False,
) -> Path:
    """A random-weight Llama of ``shape`` with the tokenizer of ``tokenizer_dir``, saved to ``out``.

    ``stops``: the tokenizer's BOS/EOS/pad ids go into the config, as a prepared model has them;
    without, EOS is unset and every stream decodes exactly the tokens asked for."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) if stops else (None, None, None)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=ids[0],
        eos_token_id=ids[1],
        pad_token_id=ids[2],
        **SHAPES[shape],
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.to(dtype=dtype).save_pretrained(out)  # type: ignore[call-arg]  # transformers wraps to()
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    del model
    return out
