"""Speculative decoding logic with a fake target and fake drafts: output = the target's greedy, k adapts;
a chunked prefill gives the same tokens, one forward per engine step, so a stop between two steps
ends it after the chunk in flight."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from services.gpu_worker.plan import Segment
from services.gpu_worker.speculative import AdaptiveK, SpeculativeDecoder

VOCAB = 50
EOS = 0


def truth(prefix: Sequence[int]) -> int:
    """The fake target's greedy next token after ``prefix`` (never EOS unless the prefix is long)."""
    return 1 + (sum(prefix) * 31 + len(prefix) * 7) % (VOCAB - 1)


class FakeTarget:
    """Logits one-hot on ``truth``; keeps the tokens written at each slot like a KV cache would."""

    def __init__(self) -> None:
        self.slots: dict[int, int] = {}
        self.calls: list[Segment] = []

    def forward(self, segments: Sequence[Segment]) -> list[torch.Tensor]:
        out = []
        for seg in segments:
            self.calls.append(seg)
            for i, t in enumerate(seg.token_ids):
                self.slots[seg.start + i] = t
            rows = range(len(seg.token_ids)) if seg.all_logits else [len(seg.token_ids) - 1]
            logits = torch.zeros(len(rows), VOCAB)
            for r, i in enumerate(rows):
                prefix = [self.slots[p] for p in range(seg.start + i + 1)]  # only KV written so far
                logits[r, truth(prefix)] = 1.0
            out.append(logits)
        return out


class FakeDraft:
    """Proposes the truth except where ``wrong(position)``; tracks commits like OgDraft must."""

    def __init__(self, context: list[int], wrong: object) -> None:
        self.seq = list(context)
        self.wrong = wrong
        self.proposal: list[int] = []

    def propose(self, k: int) -> list[int]:
        seq = list(self.seq)
        for _ in range(k):
            t = truth(seq)
            if self.wrong(len(seq)):  # type: ignore[operator]
                t = t % (VOCAB - 1) + 1
            seq.append(t)
        self.proposal = seq[len(self.seq) :]
        return self.proposal

    def commit(self, accepted: int, token: int) -> None:
        self.seq += [*self.proposal[:accepted], token]

    def close(self) -> None:
        pass


def plain(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(truth(seq))
    return seq[len(prompt) :]


def run(wrong: object, n: int = 40, k_max: int = 6) -> tuple[list[int], SpeculativeDecoder, FakeTarget]:
    target = FakeTarget()
    prompt = [5, 9, 13]
    drafts: list[FakeDraft] = []

    def make(ctx: list[int]) -> FakeDraft:
        drafts.append(FakeDraft(ctx, wrong))
        return drafts[-1]

    dec = SpeculativeDecoder(target.forward, list(range(8)), prompt, n, make, k_max=k_max)
    out = drain(dec)
    assert drafts[0].seq == dec.tokens[: len(drafts[0].seq)]  # the draft's committed tokens = the output
    return out, dec, target


def drain(dec: SpeculativeDecoder) -> list[int]:
    """Advance ``dec`` (one engine step each) until it finished; its tokens."""
    out: list[int] = []
    while not dec.finished:
        out += dec.advance()
    return out


def test_output_is_the_targets_greedy_whatever_the_draft_proposes() -> None:
    for wrong in (lambda p: False, lambda p: True, lambda p: p % 3 == 0, lambda p: p % 7 in (1, 2)):
        out, dec, _ = run(wrong)
        assert out == plain([5, 9, 13], 40)
        assert dec.finished
        with pytest.raises(RuntimeError, match="finished"):
            dec.advance()


def test_perfect_draft_grows_k_to_the_bound_and_needs_few_passes() -> None:
    _, dec, target = run(lambda p: False, n=40, k_max=6)
    assert dec.k.k == 6 and dec.accepted == dec.drafted
    assert len(target.calls) < 40 // 3  # each verify pass yields up to k_max + 1 tokens


def test_useless_draft_shrinks_k_to_one_and_still_yields_a_token_per_pass() -> None:
    _, dec, target = run(lambda p: True, n=20)
    assert dec.k.k == 1 and dec.accepted == 0
    assert len(target.calls) == 20  # prefill + one verify pass per remaining token


def test_verify_pass_covers_the_last_token_and_the_drafts() -> None:
    _, _, target = run(lambda p: False, n=12, k_max=4)
    verify = target.calls[1:]
    assert all(s.all_logits for s in verify if len(s.token_ids) > 1)
    starts = [s.start for s in verify]
    assert starts == sorted(starts) and starts[0] == 3  # after the prompt: the first token's position


def test_adaptive_k_stays_in_bounds() -> None:
    k = AdaptiveK(5, k=1)
    for _ in range(10):
        k.update(k.k, k.k)
    assert k.k == 5
    for _ in range(10):
        k.update(k.k, 0)
    assert k.k == 1
    k.update(0, 0)  # no draft: unchanged
    assert k.k == 1


PROMPT = [(7 * i) % 40 + 1 for i in range(40)]


def test_a_chunked_prefill_gives_the_same_tokens_in_forwards_of_the_chunk_size() -> None:
    whole, one = _prefill_forwards(0)
    chunked, three = _prefill_forwards(16)
    assert [(seg.start, len(seg.token_ids)) for seg in one] == [(0, 40)]
    assert [(seg.start, len(seg.token_ids)) for seg in three] == [(0, 16), (16, 16), (32, 8)]
    assert whole == chunked == plain(PROMPT, 10)


def _prefill_forwards(chunk: int) -> tuple[list[int], list[Segment]]:
    """10 tokens of PROMPT's continuation, and the prefill's forwards, with ``prefill_chunk=chunk``."""
    target = FakeTarget()
    chunks: list[int] = []
    dec = SpeculativeDecoder(
        target.forward,
        list(range(8)),
        PROMPT,
        10,
        lambda ctx: FakeDraft(ctx, lambda p: p % 3 == 0),
        prefill_chunk=chunk,
        on_prefill_chunk=lambda: chunks.append(1),
    )
    out = drain(dec)
    return out, target.calls[: len(chunks)]


def test_each_advance_is_one_forward_and_the_draft_starts_only_after_the_last_chunk() -> None:
    """What a stop during a speculative prefill relies on: the engine steps the decoder once per step,
    so a stop between two steps leaves the rest of the prompt (and the draft's own prefill) unrun."""
    target = FakeTarget()
    drafts: list[FakeDraft] = []

    def make(ctx: list[int]) -> FakeDraft:
        drafts.append(FakeDraft(ctx, lambda p: False))
        return drafts[-1]

    dec = SpeculativeDecoder(target.forward, list(range(8)), PROMPT, 10, make, prefill_chunk=16)
    assert not dec.started
    for chunk in (1, 2):
        assert dec.advance() == []  # a chunk yields no token
        assert len(target.calls) == chunk and drafts == [] and dec.started
    assert dec.advance() == plain(PROMPT, 1)  # the last chunk gives the first token, then the draft starts
    assert len(target.calls) == 3 and len(drafts) == 1
    dec.close()


def test_max_tokens_bounds_a_round_and_eos_ends_it() -> None:
    out, dec, _ = run(lambda p: False, n=5, k_max=8)
    assert len(out) == 5 and dec.generated == 5
    eos = plain([5, 9, 13], 12)[6]
    target = FakeTarget()
    dec = SpeculativeDecoder(
        target.forward,
        list(range(8)),
        [5, 9, 13],
        12,
        lambda ctx: FakeDraft(ctx, lambda p: False),
        eos=frozenset({eos}),
    )
    got = drain(dec)
    assert got == plain([5, 9, 13], 12)[: got.index(eos) + 1] and got[-1] == eos
