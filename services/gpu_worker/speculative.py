"""Speculative decoding: the edge tier's model drafts k tokens, the cloud model verifies them in one pass.

Per round, for a sequence whose committed tokens are ``t[0..n]`` (``t[n]`` has no KV yet):

1. the draft proposes ``d[0..k-1]`` greedily (:class:`OgDraft`: the edge tier's INT4 ONNX model on
   onnxruntime-genai, one ``og.Generator`` per sequence keeping its own KV);
2. the target runs ONE forward over ``[t[n], d[0..k-1]]`` at positions ``n..n+k`` with
   ``all_logits=True`` (``model.py``), giving its greedy choice ``g[i]`` after each prefix;
3. accepted = the longest ``j`` with ``g[i] == d[i]`` for ``i < j``; the round emits
   ``d[0..j-1]`` and then ``g[j]`` (the target's own token), so every round yields 1..k+1 tokens and
   each is exactly the target's greedy choice after the tokens before it: the output is plain greedy
   decoding's (tested token for token);
4. rollback: the target keeps KV for ``t[n], d[0..j-1]`` (slots past it are overwritten by the next
   round); the draft ``rewind_to``\\ s its last valid position and appends the emitted tokens.

``k`` adapts per sequence (:class:`AdaptiveK`): +2 after a round where every draft was accepted,
-1 otherwise, within 1..k_max (the schedule transformers' assisted generation calls "heuristic").
Acceptance (accepted / drafted tokens) is exported as Prometheus counters and a smoothed gauge.

Only greedy requests are speculated. Sampled requests (temperature > 0) go to the normal
continuous-batching path: a speculative-sampling acceptance rule would need the draft's full
probability rows, which onnxruntime-genai's generator does not expose per drafted token cheaply.

Which draft: any onnxruntime-genai model with the target's tokenizer (``draft_model``). The default
is the INT8 build ``draft-int8`` that `meshserve models prepare` makes (services/models/draft.py),
else the edge tier's INT4 model: INT8 agrees with the fp32 target far more often (95 % vs 78 % of
tokens teacher-forced on chat answers) for about 1.25x the draft cost per token, and is the one that
pays on CPU (docs/cloud.md, "Speculative decoding", has the numbers).

Why +2/-1 rather than k chosen from a cost model (expected tokens ``(1-a^(k+1))/(1-a)`` per
``verify(k+1) + k*draft`` for a running acceptance ``a``): replayed on measured acceptance traces
of both drafts with the measured costs, the cost-model choice was no better (INT4: 1.28-1.42x vs
1.38x; INT8: 1.54-1.90x vs 1.92x) because acceptance comes in runs, not independent tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import structlog
import torch
from prometheus_client import Counter, Gauge
from torch import Tensor

from services.common.generation import FinishReason
from services.common.sampling import SamplingParams
from services.gpu_worker.blocks import BlockManager
from services.gpu_worker.plan import Segment
from services.worker.types import NewSequence, SequenceOutput

log = structlog.get_logger(__name__)

DRAFTED = Counter(
    "meshserve_speculative_draft_tokens_total", "Draft tokens proposed to the cloud model for verification."
)
ACCEPTED = Counter("meshserve_speculative_accepted_tokens_total", "Draft tokens the cloud model accepted.")
ACCEPTANCE = Gauge(
    "meshserve_speculative_acceptance_ratio",
    "Accepted / drafted tokens, exponentially smoothed over verify rounds (all sequences).",
)
SPEC_K = Gauge("meshserve_speculative_k", "Draft length of the latest verify round (adapts per sequence).")

Forward = Callable[[Sequence[Segment]], list[Tensor]]


class Draft(Protocol):
    """A draft model's view of one sequence."""

    def propose(self, k: int) -> list[int]:
        """``k`` greedy tokens continuing the committed sequence."""
        ...

    def commit(self, accepted: int, token: int) -> None:
        """The last proposal's first ``accepted`` tokens were kept, then ``token`` was appended."""
        ...

    def close(self) -> None: ...


class OgDraft:
    """One sequence on an onnxruntime-genai generator (greedy); rolls back with ``rewind_to``.

    After ``append_tokens`` og has the logits of the next token, so the first ``generate_next_token``
    of a proposal runs no model; each later one runs the previous draft token. A generated token has
    no KV until the next forward pass, hence the rewind point in :meth:`commit`.
    """

    def __init__(self, model: Any, context: Sequence[int], max_length: int) -> None:
        import onnxruntime_genai as og

        params = og.GeneratorParams(model)
        params.set_search_options(max_length=max_length, do_sample=False)
        self._gen: Any = og.Generator(model, params)
        self._gen.append_tokens(list(context))
        self._committed = len(context)
        self._kv = len(context)  # tokens with KV in the generator
        self._length = len(context)  # tokens in the generator (the last generated one has no KV)
        self._proposal: list[int] = []

    def propose(self, k: int) -> list[int]:
        out: list[int] = []
        for _ in range(k):
            if self._gen.is_done():  # the draft produced EOS or hit max_length: propose fewer
                break
            self._gen.generate_next_token()
            out.append(int(self._gen.get_next_tokens()[0]))
        if out:
            self._kv = self._committed + len(out) - 1
            self._length = self._committed + len(out)
        self._proposal = out
        return out

    def commit(self, accepted: int, token: int) -> None:
        tail = [*self._proposal[:accepted], token]  # positions committed .. committed + accepted
        keep = min(self._committed + accepted, self._kv)
        if keep < self._length:
            self._gen.rewind_to(keep)
        self._gen.append_tokens(tail[keep - self._committed :])
        self._committed += len(tail)
        self._kv = self._length = self._committed
        self._proposal = []

    def close(self) -> None:
        self._gen = None


class AdaptiveK:
    """Draft length from the acceptance history: +2 when a round accepts all, else -1; in 1..k_max."""

    def __init__(self, k_max: int, k: int | None = None) -> None:
        self.k_max = k_max
        self.k = min(k_max, k if k is not None else 4)

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.k = min(self.k_max, self.k + 2) if accepted == drafted else max(1, self.k - 1)


class _Smoothed:
    """Exponentially smoothed acceptance across sequences (for the gauge)."""

    def __init__(self, alpha: float = 0.05) -> None:
        self.alpha = alpha
        self.value: float | None = None
        self._lock = threading.Lock()

    def add(self, drafted: int, accepted: int) -> None:
        with self._lock:
            rate = accepted / drafted
            self.value = rate if self.value is None else self.value + self.alpha * (rate - self.value)
            ACCEPTANCE.set(self.value)


SMOOTHED = _Smoothed()


def verify_round(
    forward: Forward, last: int, drafts: Sequence[int], start: int, table: Sequence[int]
) -> tuple[int, int]:
    """One verify pass: (accepted drafts, the target's next token after them)."""
    logits = forward([Segment([last, *drafts], start, table, all_logits=len(drafts) > 0)])[0]
    choices = torch.argmax(logits, dim=-1).tolist()
    accepted = 0
    while accepted < len(drafts) and choices[accepted] == drafts[accepted]:
        accepted += 1
    return accepted, int(choices[accepted])


class SpeculativeDecoder:
    """Greedy speculative decoding of one sequence over a target ``forward`` and KV ``table``.

    ``forward`` runs segments over the cache that ``table`` (block ids) indexes; ``table`` must hold
    ``len(prompt) + max_tokens + k_max`` tokens. Each :meth:`advance` does one unit of work and
    returns the tokens it produced: a prefill chunk of ``prefill_chunk`` tokens (0: the whole prompt;
    the last chunk gives the first token), then one draft-and-verify round (1..k+1 tokens). The engine
    loop calls it once per step, so a stop reaches a long prompt's prefill after one chunk.
    """

    def __init__(
        self,
        forward: Forward,
        table: Sequence[int],
        prompt: Sequence[int],
        max_tokens: int,
        make_draft: Callable[[list[int]], Draft],
        *,
        k_max: int = 8,
        eos: frozenset[int] = frozenset(),
        prefill_chunk: int = 0,
        on_prefill_chunk: Callable[[], None] | None = None,
    ) -> None:
        self.forward = forward
        self.prefill_chunk = prefill_chunk
        self._on_prefill_chunk = on_prefill_chunk
        self.table = list(table)
        self.tokens = list(prompt)
        self.max_tokens = max_tokens
        self.make_draft = make_draft
        self.k = AdaptiveK(k_max)
        self.eos = eos
        self.draft: Draft | None = None
        self._prefilled = 0
        self.generated = 0
        self.finished = False
        """Every token is produced (EOS or max_tokens)."""
        self.drafted = 0
        self.accepted = 0
        self.rounds = 0

    @property
    def started(self) -> bool:
        """Whether a forward ran for it (a prefill chunk)."""
        return self._prefilled > 0

    def advance(self) -> list[int]:
        """One prefill chunk or one round (see the class docstring); its new tokens, in order."""
        if self.finished:
            raise RuntimeError("sequence is finished")
        if self.generated == 0:
            return self._prefill_chunk()
        return self._round()

    def _emit(self, tokens: Sequence[int]) -> list[int]:
        out = []
        for t in tokens:
            out.append(t)
            self.generated += 1
            if t in self.eos or self.generated >= self.max_tokens:
                self.finished = True
                break
        return out

    def _prefill_chunk(self) -> list[int]:
        """The prompt's next chunk; the last one's logits give the first token (and start the draft)."""
        n = len(self.tokens)
        start = self._prefilled
        end = min(n, start + (self.prefill_chunk or n))
        logits = self.forward([Segment(self.tokens[start:end], start, self.table)])[0]
        self._prefilled = end
        if self._on_prefill_chunk is not None:
            self._on_prefill_chunk()
        if end < n:
            return []
        first = int(torch.argmax(logits[-1]).item())
        self.tokens.append(first)
        out = self._emit([first])
        if not self.finished:
            self.draft = self.make_draft(list(self.tokens))
        return out

    def _round(self) -> list[int]:
        assert self.draft is not None
        k = max(0, min(self.k.k, self.max_tokens - self.generated - 1))
        drafts = self.draft.propose(k) if k else []
        k = len(drafts)
        n = len(self.tokens) - 1
        accepted, token = verify_round(self.forward, self.tokens[-1], drafts, n, self.table)
        emitted = [*drafts[:accepted], token]
        self.tokens.extend(emitted)
        out = self._emit(emitted)
        if k:
            self.rounds += 1
            self.drafted += k
            self.accepted += accepted
            DRAFTED.inc(k)
            ACCEPTED.inc(accepted)
            SMOOTHED.add(k, accepted)
            SPEC_K.set(k)
            self.k.update(k, accepted)
        if not self.finished:
            self.draft.commit(accepted, token)
        return out

    def close(self) -> None:
        if self.draft is not None:
            self.draft.close()
            self.draft = None


def load_draft_model(path: Path, threads: int = 1) -> Any:
    """The draft's ``og.Model`` (shared by every sequence's generator)."""
    import json

    import onnxruntime_genai as og

    config = og.Config(str(path))
    if threads:
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    return og.Model(config)


def draft_factory(model: Any, max_length: int) -> Callable[[list[int]], Draft]:
    return lambda context: OgDraft(model, context, max_length)


def greedy_only(sampling: SamplingParams) -> bool:
    """Whether a request is speculated (greedy ones only, without penalties or a structured-output
    constraint: the draft and the verify pass apply none; see the module docstring)."""
    return sampling.greedy and not sampling.penalized and sampling.structured is None


class Speculation:
    """The speculative sequences of one cloud engine (``CloudEngine.speculate``): greedy requests without
    logprobs or a resumed stream, decoded by draft-and-verify rounds over the engine's KV blocks and its
    scheduler's ``forward`` (the function the batch steps use, so under tensor parallelism they are
    mirrored on the follower ranks), one unit each (a prefill chunk, or a round) per engine step, after
    the batch's packed step: on CPU a verify pass of k+1 tokens costs about what a batch step of k+1
    sequences does, and latency for a single stream is what speculation is for. A sequence whose KV the
    budget has no room for right now goes to the scheduler, which queues it. No prefix cache (it
    prefills its whole prompt), in chunks of whole blocks within the scheduler's step budget, so a stop
    reaches it after one chunk."""

    def __init__(
        self,
        draft_model: Any,
        *,
        k_max: int,
        forward: Forward,
        blocks: BlockManager,
        eos: frozenset[int],
        max_step_tokens: int,
    ) -> None:
        self.draft_model = draft_model
        self.k_max = k_max
        self._forward = forward
        self._blocks = blocks
        self._eos = eos
        bt = blocks.block_tokens
        self._chunk = max(bt, max_step_tokens // bt * bt)
        self.prefill_chunks = 0
        """Prefill forwards of speculative sequences so far (their prompts go in chunks)."""
        self.live: dict[int, tuple[SpeculativeDecoder, list[int], NewSequence]] = {}
        """Speculative sequences by id: their decoder, KV blocks and spec."""

    @staticmethod
    def accepts(spec: NewSequence) -> bool:
        s = spec.sampling
        return greedy_only(s) and not spec.replay and not s.logprobs and spec.fork_of is None

    def add(self, spec: NewSequence) -> bool:
        """Decode ``spec`` speculatively; False when its KV blocks cannot be had now."""
        bt = self._blocks.block_tokens
        max_tokens = max(1, spec.sampling.max_tokens)
        need = -(-(len(spec.prompt_ids) + max_tokens + self.k_max + 1) // bt)
        with self._blocks.lock:
            blocks = self._blocks.allocate(need)
        if blocks is None:
            return False
        max_length = len(spec.prompt_ids) + max_tokens + self.k_max + 2
        decoder = SpeculativeDecoder(
            self._forward,
            blocks,
            spec.prompt_ids,
            max_tokens,
            draft_factory(self.draft_model, max_length),
            k_max=self.k_max,
            eos=self._eos,
            prefill_chunk=self._chunk,
            on_prefill_chunk=self._count_chunk,
        )
        self.live[spec.id] = (decoder, blocks, spec)
        return True

    def _count_chunk(self) -> None:
        self.prefill_chunks += 1

    def take_back(self, seq_id: int) -> NewSequence | None:
        """Give up speculating ``seq_id``, not stepped yet (another choice forks it: the scheduler's forks
        share its prefill); its spec, for the scheduler. None: not a speculative sequence."""
        entry = self.live.get(seq_id)
        if entry is None:
            return None
        decoder, _, spec = entry
        if decoder.started:
            raise RuntimeError(f"sequence {seq_id} is decoding speculatively and cannot be forked")
        self.stop(seq_id)
        return spec

    def stop(self, seq_id: int) -> bool:
        """Free a speculative sequence's KV blocks and draft; False if ``seq_id`` is not one."""
        entry = self.live.pop(seq_id, None)
        if entry is None:
            return False
        decoder, blocks, _ = entry
        decoder.close()
        with self._blocks.lock:
            self._blocks.release(blocks)
        return True

    def step(self) -> list[SequenceOutput]:
        """One unit of every speculative sequence; the outputs of those that produced tokens."""
        outputs = []
        for seq_id, (decoder, _, spec) in list(self.live.items()):
            first = decoder.generated == 0
            try:
                tokens = decoder.advance()
            except Exception as exc:  # that sequence fails, the others go on
                self.stop(seq_id)
                outputs.append(SequenceOutput(seq_id, error=exc))
                continue
            if not tokens:
                continue  # a prefill chunk
            out = SequenceOutput(seq_id, tokens, prefill_tokens=len(spec.prompt_ids) if first else None)
            if decoder.finished:
                out.finish = FinishReason.STOP if tokens[-1] in self._eos else FinishReason.LENGTH
                self.stop(seq_id)
            outputs.append(out)
        return outputs
