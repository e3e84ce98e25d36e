"""The default model called directly (no mesh), as the reference for token-for-token checks.

Edge reference: onnxruntime-genai greedy on the INT4 model. Cloud reference: transformers
``generate(do_sample=False)`` on the HF checkpoint. Prompts are tokenized with the model's
tokenizer.json exactly as the router does. Trailing EOS is dropped (the mesh does not stream it).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from services.models.paths import model_paths

EOS = 2


@cache
def _tokenizer() -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_paths().hf_dir / "tokenizer.json"))


def encode(prompt: str) -> list[int]:
    return list(_tokenizer().encode(prompt).ids)


def _strip_eos(tokens: list[int]) -> list[int]:
    return tokens[:-1] if tokens and tokens[-1] == EOS else tokens


@cache
def _onnx_model() -> Any:
    import onnxruntime_genai as og

    return og.Model(str(model_paths().edge_dir))


def edge_greedy(prompt: str, max_tokens: int) -> list[int]:
    import onnxruntime_genai as og

    ids = encode(prompt)
    params = og.GeneratorParams(_onnx_model())
    params.set_search_options(max_length=len(ids) + max_tokens, do_sample=False)
    generator = og.Generator(_onnx_model(), params)
    generator.append_tokens(ids)
    out: list[int] = []
    while not generator.is_done():
        generator.generate_next_token()
        out.append(int(generator.get_next_tokens()[0]))
    return _strip_eos(out)


@cache
def _torch_model() -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_paths().hf_dir)).eval()


def cloud_greedy(prompt: str, max_tokens: int) -> list[int]:
    import torch

    ids = encode(prompt)
    with torch.inference_mode():
        out = _torch_model().generate(
            torch.tensor([ids]),
            max_new_tokens=max_tokens,
            do_sample=False,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )
    return _strip_eos([int(t) for t in out[0, len(ids) :]])
