"""transformers/torch engine: one model shared by all sequences, a DynamicCache per sequence.

A plain incremental decode loop (prefill the context, then one token per step with
``past_key_values``) — the same computation as ``model.generate``, so greedy output matches it token
for token. Sampling uses transformers' own logits warpers (temperature, top-k, top-p, in
``generate``'s order) and a per-sequence ``torch.Generator``, so a seed reproduces its tokens
whatever else runs concurrently. Continuous batching and tensor parallelism come later.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import cast

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from services.common.worker.types import EngineInfo, SamplingConfig

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    """``auto`` is CUDA when available, else CPU; ``cuda`` without a GPU is an error."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda but torch sees no CUDA GPU; set the device to auto or cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


class TorchSequence:
    """One generation: prefill on the first ``step``, then one token per step from the KV cache."""

    def __init__(
        self, engine: TorchEngine, token_ids: Sequence[int], sampling: SamplingConfig, replay: Sequence[int] = ()
    ) -> None:
        self._model = engine.model
        self._device = engine.device
        self._context: list[int] | None = list(token_ids)
        self._replay: Sequence[int] = tuple(replay)
        self._cache: DynamicCache | None = None
        self._last = 0
        self._greedy = sampling.greedy
        self._warpers = LogitsProcessorList()
        self._rng: torch.Generator | None = None
        if not self._greedy:
            if sampling.temperature != 1.0:
                self._warpers.append(TemperatureLogitsWarper(sampling.temperature))
            if sampling.top_k > 0:
                self._warpers.append(TopKLogitsWarper(sampling.top_k))
            if sampling.top_p < 1.0:
                self._warpers.append(TopPLogitsWarper(sampling.top_p))
            self._rng = torch.Generator(device=self._device)
            if sampling.seed is not None:
                self._rng.manual_seed(sampling.seed & 0xFFFF_FFFF_FFFF_FFFF)
            else:
                self._rng.seed()

    @torch.inference_mode()
    def step(self) -> int:
        if self._context is not None:
            self._cache = DynamicCache(config=self._model.config)
            input_ids = torch.tensor([self._context], dtype=torch.long, device=self._device)
            self._context = None
            for token in self._replay:  # replayed as decoded: one forward pass each (see Engine.start)
                self._model(input_ids=input_ids, past_key_values=self._cache, use_cache=True, logits_to_keep=1)
                input_ids = torch.tensor([[token]], dtype=torch.long, device=self._device)
            self._replay = ()
        elif self._cache is not None:
            input_ids = torch.tensor([[self._last]], dtype=torch.long, device=self._device)
        else:
            raise RuntimeError("sequence is closed")
        out = self._model(input_ids=input_ids, past_key_values=self._cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1, :].float()
        if self._greedy:
            token = int(torch.argmax(logits, dim=-1).item())
        else:
            scores = self._warpers(cast(torch.LongTensor, input_ids), logits)
            probs = torch.softmax(scores, dim=-1)
            token = int(torch.multinomial(probs, num_samples=1, generator=self._rng).item())
        self._last = token
        return token

    def close(self) -> None:
        self._cache = None
        self._context = None


class TorchEngine:
    """A causal LM from an HF directory or hub id, in eval mode on ``device``."""

    def __init__(
        self, model: str, *, model_id: str, device: str = "auto", dtype: str = "auto", threads: int = 0
    ) -> None:
        if threads:
            torch.set_num_threads(threads)  # process-wide: one worker per process
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(model, dtype=self.dtype)
        self.model.to(self.device)  # type: ignore[arg-type]
        self.model.eval()
        tokenizer_file = Path(model) / "tokenizer.json"
        if tokenizer_file.is_file():
            self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        else:
            self._tokenizer = AutoTokenizer.from_pretrained(model).backend_tokenizer
        config = self.model.config
        eos: set[int] = set()
        for source in (self.model.generation_config.eos_token_id, config.eos_token_id):
            if source is not None:
                eos.update(source if isinstance(source, list) else [source])
        self._info = EngineInfo(
            model_id=model_id,
            vocab_size=int(config.vocab_size),
            context_length=int(getattr(config, "max_position_embeddings", 2048)),
            eos_token_ids=frozenset(eos),
        )

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def start(self, token_ids: Sequence[int], sampling: SamplingConfig, replay: Sequence[int] = ()) -> TorchSequence:
        return TorchSequence(self, token_ids, sampling, replay=replay)
