"""onnxruntime-genai engine: one ``og.Model`` shared by all sequences, one ``og.Generator`` each.

Sampling is onnxruntime-genai's own (``set_search_options``): greedy when temperature is 0, else
temperature/top-k/top-p with a per-generator ``random_seed`` (0.18 seeds each generator, so the same
seed gives the same tokens however many sequences run at once; top_k=0 means the whole vocabulary).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnxruntime_genai as og
from tokenizers import Tokenizer

from services.common.worker.types import EngineInfo, SamplingConfig

_SEED_MASK = 0x7FFFFFFF  # og's random_seed is a C int


class OgSequence:
    """One generation on an ``og.Generator``; the first ``step`` appends (prefills) the context."""

    def __init__(self, model: og.Model, token_ids: Sequence[int], sampling: SamplingConfig) -> None:
        options: dict[str, Any] = {"max_length": len(token_ids) + sampling.max_tokens, "do_sample": False}
        if not sampling.greedy:
            seed = sampling.seed if sampling.seed is not None else random.getrandbits(31)
            options.update(
                do_sample=True,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                random_seed=seed & _SEED_MASK,
            )
        params = og.GeneratorParams(model)
        params.set_search_options(**options)
        self._generator: og.Generator | None = og.Generator(model, params)
        self._pending: list[int] | None = list(token_ids)

    def step(self) -> int:
        generator = self._generator
        if generator is None:
            raise RuntimeError("sequence is closed")
        if self._pending is not None:
            generator.append_tokens(self._pending)
            self._pending = None
        generator.generate_next_token()
        return int(generator.get_next_tokens()[0])

    def close(self) -> None:
        self._generator = None  # frees the generator's KV buffers


class OgEngine:
    """The INT4 ONNX model of ``model_dir`` (as written by onnxruntime-genai's model builder)."""

    def __init__(self, model_dir: Path, *, model_id: str, threads: int = 0) -> None:
        config = og.Config(str(model_dir))
        if threads:
            config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self._model = og.Model(config)
        genai = json.loads((model_dir / "genai_config.json").read_text())["model"]
        eos = genai.get("eos_token_id", [])
        self._info = EngineInfo(
            model_id=model_id,
            vocab_size=int(genai["vocab_size"]),
            context_length=int(genai["context_length"]),
            eos_token_ids=frozenset(eos if isinstance(eos, list) else [eos]),
        )
        self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def model(self) -> og.Model:
        return self._model

    def start(self, token_ids: Sequence[int], sampling: SamplingConfig) -> OgSequence:
        return OgSequence(self._model, token_ids, sampling)
