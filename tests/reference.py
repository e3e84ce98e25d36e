"""The default model called directly (no mesh), as the reference for token-for-token checks.

Edge reference: the edge worker's batched engine on the INT4 model, one sequence alone (its tokens
do not depend on what else shares a decode step; onnxruntime-genai's one-row decode rounds
differently, docs/edge.md). Cloud reference: transformers
``generate(do_sample=False)`` on the HF checkpoint. Prompts are tokenized with the model's
tokenizer.json exactly as the router does. Trailing EOS is dropped (the mesh does not stream it).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from services.common.model_paths import model_paths

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
def edge_engine() -> Any:
    """The batched engine with the int4 kernel an edge worker runs here (``auto``: native where it builds
    and runs, else MLAS: their greedy tokens differ at near-ties, so the reference must use the same)."""
    from services.common.config import load_settings
    from services.edge_worker.config import EdgeWorkerSettings
    from services.edge_worker.ort_engine import OrtEngine
    from services.edge_worker.server import int4_kernel

    kernel = int4_kernel(load_settings(EdgeWorkerSettings))
    return OrtEngine(model_paths().edge_dir, model_id="reference", threads=1, max_batch=2, int4_kernel=kernel)


def edge_continuation(ids: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of the edge engine after ``ids`` (trailing EOS dropped)."""
    from benchmarks.engine_stepper import EngineStepper
    from services.common.sampling import SamplingParams

    return _strip_eos(EngineStepper(edge_engine()).generate(ids, SamplingParams(max_tokens=max_tokens)))


def edge_greedy(prompt: str, max_tokens: int) -> list[int]:
    return edge_continuation(encode(prompt), max_tokens)


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
