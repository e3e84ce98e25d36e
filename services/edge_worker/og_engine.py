"""onnxruntime-genai engine: one ``og.Model`` shared by all sequences, one ``og.Generator`` each.

Sampling is onnxruntime-genai's own (``set_search_options``): greedy when temperature is 0, else
temperature/top-k/top-p with a per-generator ``random_seed`` (0.18 seeds each generator, so the same
seed gives the same tokens however many sequences run at once; top_k=0 means the whole vocabulary).

The engine core contract (services/worker/types.py): a step runs every live sequence's generator
once, one after the other (onnxruntime-genai holds the GIL during a step, so threads would take turns
anyway); a sequence's first step prefills it.

Chat turns: a sequence added with ``hold`` survives its turn (its generator has KV room for later
turns); the next turn's context is matched against the tokens the generator already holds, the
generator is rewound to the longest common prefix whose KV exists (``rewind_to``) and only the rest is
appended (prefilled). A generated token has no KV until the next forward pass, so the usable prefix
ends one token before the last generated one.
"""

from __future__ import annotations

import gc
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnxruntime_genai as og
from tokenizers import Tokenizer

from services.common.errors import FailedPrecondition, Unavailable
from services.common.generation import FinishReason
from services.common.sampling import SamplingParams
from services.worker.types import Engine, EngineCapabilities, EngineInfo, NewSequence, SequenceOutput

_SEED_MASK = 0x7FFFFFFF  # og's random_seed is a C int


def _search_options(sampling: SamplingParams) -> dict[str, Any]:
    # og's own repetition_penalty (over the prompt and the output, as transformers'): the chat default
    penalty = {"repetition_penalty": sampling.repetition_penalty} if sampling.repetition_penalty != 1.0 else {}
    if sampling.greedy:
        return {"do_sample": False, **penalty}
    seed = sampling.seed if sampling.seed is not None else random.getrandbits(31)
    return {
        **penalty,
        "do_sample": True,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "random_seed": seed & _SEED_MASK,
    }


def _reusable_key(sampling: SamplingParams) -> tuple[Any, ...] | None:
    """Turns with equal keys may share a generator; None (an explicit seed) never shares one.

    A seeded turn must give the tokens a fresh generator gives (the response cache relies on it), and
    a reused generator's random state has moved on, so seeded turns always start fresh.
    """
    if sampling.greedy:
        return ("greedy", sampling.repetition_penalty)
    if sampling.seed is not None:
        return None
    return ("sample", sampling.temperature, sampling.top_p, sampling.top_k, sampling.repetition_penalty)


class OgSequence:
    """One generation on an ``og.Generator``; the first ``step`` appends (prefills) the pending tokens.

    ``repetition_penalty`` is og's own search option; frequency/presence penalties, ``logit_bias`` and
    ``min_tokens`` have no og hook: the engine does not declare them, so the worker refuses them."""

    def __init__(
        self,
        model: og.Model,
        token_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        max_length: int | None = None,
        replay: Sequence[int] = (),
    ) -> None:
        self.max_length = max_length or len(token_ids) + len(replay) + sampling.max_tokens
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=self.max_length, **_search_options(sampling))
        self._generator: og.Generator | None = og.Generator(model, params)
        self._key = _reusable_key(sampling)
        self._tokens: list[int] = []  # the generator's sequence
        self._kv_len = 0  # leading tokens of ``_tokens`` whose KV has been computed
        self._pending: list[int] | None = list(token_ids)
        self._replay = list(replay)  # fed one token per forward pass after the prefill (NewSequence.replay)
        self.prefill_tokens = len(token_ids) + len(replay)
        """Tokens the next ``step`` prefills (all of the context, or only a chat turn's new ones)."""
        self.max_new = sampling.max_tokens
        self.generated = 0
        self.hold = False

    def step(self) -> int:
        generator = self._generator
        if generator is None:
            raise RuntimeError("sequence is closed")
        if self._pending is not None:
            generator.append_tokens(self._pending)
            self._tokens += self._pending
            self._pending = None
            for token in self._replay:
                generator.append_tokens([token])
                self._tokens.append(token)
            self._replay = []
        self._kv_len = len(self._tokens)
        generator.generate_next_token()
        token = int(generator.get_next_tokens()[0])
        self._tokens.append(token)
        self.generated += 1
        return token

    def reuse(self, token_ids: Sequence[int], sampling: SamplingParams) -> bool:
        """Prepare the next turn over ``token_ids`` on this generator; False if it cannot be reused.

        Reuse needs the same sampling kind, room for the turn within ``max_length``, and a non-empty
        common prefix with what the generator holds. On success ``prefill_tokens`` is the new part.
        """
        key = _reusable_key(sampling)
        if self._generator is None or key is None or key != self._key:
            return False
        if len(token_ids) + sampling.max_tokens > self.max_length:
            return False
        common = 0
        limit = min(self._kv_len, len(token_ids) - 1)  # at least one token must run to get logits
        while common < limit and self._tokens[common] == token_ids[common]:
            common += 1
        if common == 0:
            return False
        if common < len(self._tokens):
            self._generator.rewind_to(common)
        self._tokens = self._tokens[:common]
        self._kv_len = common
        self._pending = list(token_ids[common:])
        self.prefill_tokens = len(self._pending)
        self.max_new = sampling.max_tokens
        self.generated = 0
        return True

    def close(self) -> None:
        self._generator = None  # frees the generator's KV buffers


class OgEngine(Engine):
    """The INT4 ONNX model of ``model_dir`` (as written by onnxruntime-genai's model builder).

    ``chat_reserve_tokens``: room kept in a chat sequence's KV buffer beyond its first turn, so later
    turns can extend it in place (the builder's CPU config preallocates KV to ``max_length``).
    """

    def __init__(self, model_dir: Path, *, model_id: str, threads: int = 0, chat_reserve_tokens: int = 512) -> None:
        def load() -> og.Model:
            config = og.Config(str(model_dir))
            if threads:
                config.overlay(
                    json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}})
                )
            return og.Model(config)

        self._load = load
        self._model: og.Model | None = load()
        genai = json.loads((model_dir / "genai_config.json").read_text())["model"]
        eos = genai.get("eos_token_id", [])
        self._info = EngineInfo(
            model_id=model_id,
            vocab_size=int(genai["vocab_size"]),
            context_length=int(genai["context_length"]),
            eos_token_ids=frozenset(eos if isinstance(eos, list) else [eos]),
            build=f"onnx-int4:{model_dir.name}/og",
        )
        self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.chat_reserve_tokens = chat_reserve_tokens
        # og's generator exposes no logits (no logprobs, no grammar mask) and only its own repetition penalty
        self._caps = EngineCapabilities(
            "og",
            chat=True,
            sleeps=True,
            refusal_hint="use the batched edge engine (MESHSERVE_EDGE_WORKER_ENGINE=batched)",
        )
        self._live: dict[int, OgSequence] = {}
        self._held: dict[int, OgSequence] = {}

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def capabilities(self) -> EngineCapabilities:
        return self._caps

    @property
    def model(self) -> og.Model:
        if self._model is None:
            raise FailedPrecondition("the og engine's model is released (asleep)")
        return self._model

    def release_model(self) -> None:
        """Drop the ``og.Model`` (its session and weights) and every held chat generator (loop thread,
        no live sequence: services/worker/sleep.py)."""
        if self._live:
            raise FailedPrecondition("the og engine cannot release its model while sequences run")
        for seq in self._held.values():
            seq.close()
        self._held.clear()
        self._model = None
        gc.collect()

    def restore_model(self) -> None:
        """Load the ``og.Model`` again as at start; Unavailable when the load fails."""
        if self._model is not None:
            return
        try:
            self._model = self._load()
        except Exception as exc:
            raise Unavailable(f"the edge model failed to load ({exc})") from None

    def add(self, spec: NewSequence) -> None:
        if spec.reuse is not None and (held := self._held.pop(spec.reuse, None)) is not None:
            if not spec.replay and held.reuse(spec.prompt_ids, spec.sampling):  # a replay runs afresh
                held.hold = spec.hold
                self._live[spec.id] = held
                return
            held.close()
        max_length = None
        if spec.hold:  # with KV room for later turns (see ``OgSequence.reuse``)
            wanted = len(spec.prompt_ids) + spec.sampling.max_tokens + self.chat_reserve_tokens
            max_length = min(self._info.context_length, wanted)
        seq = OgSequence(self.model, spec.prompt_ids, spec.sampling, max_length=max_length, replay=spec.replay)
        seq.hold = spec.hold
        self._live[spec.id] = seq

    def stop(self, seq_id: int, hold: bool = False) -> None:
        seq = self._live.pop(seq_id, None)
        if seq is None:
            seq, hold = self._held.pop(seq_id, None), False
        if seq is None:
            return
        if hold and seq.hold:
            self._held[seq_id] = seq
        else:
            seq.close()

    def next_step_in(self) -> float | None:
        return 0.0 if self._live else None

    def step(self) -> list[SequenceOutput]:
        outputs = []
        eos = self._info.eos_token_ids
        for seq_id, seq in list(self._live.items()):
            first = seq.generated == 0
            try:
                token = seq.step()
            except Exception as exc:  # that sequence fails, the others go on
                self.stop(seq_id)
                outputs.append(SequenceOutput(seq_id, error=exc))
                continue
            out = SequenceOutput(seq_id, [token], prefill_tokens=seq.prefill_tokens if first else None)
            if token in eos or seq.generated >= seq.max_new:
                out.finish = FinishReason.STOP if token in eos else FinishReason.LENGTH
                self.stop(seq_id, hold=True)
            outputs.append(out)
        return outputs
