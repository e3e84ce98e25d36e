"""The batched edge engine on the real INT4 model, driven as the worker's engine loop drives it (add /
step / stop, benchmarks/engine_stepper.py): batch invariance, replay, chats, parking, stop, sampling."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace

import onnxruntime_genai as og
import pytest
from prometheus_client import REGISTRY

from benchmarks.engine_stepper import EngineStepper, SequenceResult
from services.common.generation import FinishReason
from services.common.model_paths import model_paths
from services.common.sampling import SamplingParams
from services.edge_worker.ort_engine import OrtEngine
from services.edge_worker.spin import SessionChooser

pytestmark = pytest.mark.integration
PROMPTS = ["Name three colours.", "What is the sea?", "Tell me a short story about a cat.", "Count to five."]
FOLLOW = "<|im_end|>\n<|im_start|>user\nAnd two animals?<|im_end|>\n"


@pytest.fixture(scope="module")
def engine() -> Iterator[OrtEngine]:
    # A small first KV capacity and prefill chunk, so growth and chunking run too.
    engine = OrtEngine(model_paths().edge_dir, model_id="t", threads=1, max_batch=4, kv_capacity=16, prefill_chunk=16)
    yield engine
    engine.close()


def chat(engine: OrtEngine, text: str) -> list[int]:
    ids = engine.tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n").ids
    return list(ids)


def ids_of(engine: OrtEngine, text: str) -> list[int]:
    return list(engine.tokenizer.encode(text).ids)


def generate(engine: OrtEngine, ids: list[int], n: int, sampling: SamplingParams | None = None) -> list[int]:
    """One sequence alone, run to its end: at most ``n`` tokens (an EOS ends it and is the last)."""
    return EngineStepper(engine).generate(ids, sampling or SamplingParams(max_tokens=n))


def together(
    engine: OrtEngine, runs: Sequence[tuple[list[int], int | SamplingParams]], **options: object
) -> list[list[int]]:
    """The sequences added at once and stepped together until all ended; their tokens in order."""
    results = run_together(engine, runs, **options)
    for result in results:
        if result.error is not None:
            raise result.error
    return [result.tokens for result in results]


def run_together(
    engine: OrtEngine, runs: Sequence[tuple[list[int], int | SamplingParams]], **options: object
) -> list[SequenceResult]:
    driver = EngineStepper(engine)
    seq_ids = [
        driver.add(ids, SamplingParams(max_tokens=how) if isinstance(how, int) else how, **options) for ids, how in runs
    ]
    results = driver.run(seq_ids)
    return [results[i] for i in seq_ids]


def test_greedy_tokens_do_not_depend_on_what_shares_the_batch(engine: OrtEngine) -> None:
    prompts = [chat(engine, p) for p in PROMPTS]
    alone = [generate(engine, p, 12) for p in prompts]
    rows_before, steps_before = engine.rows, engine.steps
    # Six at once on four slots: batches of different sizes and members, two sequences wait in the engine.
    both = together(engine, [(p, 12) for p in [*prompts, *prompts[:2]]])
    assert both == [*alone, *alone[:2]]
    assert engine.rows - rows_before > engine.steps - steps_before  # some decode calls had several rows


def test_a_sequence_alone_gets_the_tokens_it_gets_among_fifteen_others() -> None:
    engine = OrtEngine(model_paths().edge_dir, model_id="t", threads=1, max_batch=16)
    try:
        texts = [*PROMPTS, *(f"Say something about the number {i}." for i in range(12))]
        prompts = [chat(engine, t) for t in texts]
        alone = generate(engine, prompts[2], 16)
        driver = EngineStepper(engine)
        seq_ids = [driver.add(p, SamplingParams(max_tokens=16 if i == 2 else 8 + i)) for i, p in enumerate(prompts)]
        first = driver.step()  # all sixteen prefill in the first step
        assert len(prompts) == len(first) == 16
        rows, steps = engine.rows, engine.steps
        driver.step()
        assert (engine.rows - rows, engine.steps - steps) == (16, 1)  # then one decode call of sixteen rows
        results = driver.run(seq_ids)
        assert results[seq_ids[2]].tokens == alone
    finally:
        engine.close()


def test_new_prompts_of_one_length_share_a_prefill_call_and_decode_as_they_do_alone(engine: OrtEngine) -> None:
    prompts = [chat(engine, p)[:5] for p in PROMPTS]  # four different prompts of five tokens
    alone = [generate(engine, p, 8) for p in prompts]
    calls, rows = engine.prefill_calls, engine.prefill_rows
    metric_calls, metric_rows = prefill_metrics()
    # Added together: their first chunks are prefilled in one step, 3 x 5 tokens in one call (at most
    # prefill_chunk tokens), the fourth in the next call.
    driver = EngineStepper(engine)
    seq_ids = [driver.add(p, SamplingParams(max_tokens=8)) for p in prompts]
    assert len(driver.step()) == 4  # each got its first token from that step
    assert (engine.prefill_calls - calls, engine.prefill_rows - rows) == (2, 4)
    results = driver.run(seq_ids)
    assert [results[i].tokens for i in seq_ids] == alone
    after_calls, after_rows = prefill_metrics()  # meshserve_edge_model_{calls,rows}_total{kind="prefill"}
    assert after_calls - metric_calls == engine.prefill_calls - calls
    assert after_rows - metric_rows == engine.prefill_rows - rows


def prefill_metrics() -> tuple[float, float]:
    calls = REGISTRY.get_sample_value("meshserve_edge_model_calls_total", {"kind": "prefill"})
    rows = REGISTRY.get_sample_value("meshserve_edge_model_rows_total", {"kind": "prefill"})
    assert calls is not None and rows is not None
    return calls, rows


def test_first_token_equals_onnxruntime_genai(engine: OrtEngine) -> None:
    model = og.Model(str(model_paths().edge_dir))
    for text in PROMPTS[:2]:
        ids = chat(engine, text)
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + 1, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        generator.generate_next_token()
        assert generate(engine, ids, 1) == [int(generator.get_next_tokens()[0])]


def test_every_output_ends_with_its_finish_reason_and_reports_its_prefill(engine: OrtEngine) -> None:
    prompt = chat(engine, PROMPTS[0])
    driver = EngineStepper(engine)
    seq_id = driver.add(prompt, SamplingParams(max_tokens=3))
    outputs = [out for _ in range(20) for out in driver.step() if out.id == seq_id]
    assert [len(out.tokens) for out in outputs] == [1, 1, 1]  # one token per step
    assert outputs[0].prefill_tokens == len(prompt) and all(out.prefill_tokens is None for out in outputs[1:])
    assert [out.finish for out in outputs] == [None, None, FinishReason.LENGTH]
    assert engine.next_step_in() is None  # nothing left to step
    said = EngineStepper(engine)
    result = said.run([said.add(chat(engine, "Say yes."), SamplingParams(max_tokens=30))]).popitem()[1]
    assert result.finish == FinishReason.STOP and result.tokens[-1] in engine.info.eos_token_ids


def test_replayed_tokens_continue_exactly_like_the_undisturbed_run(engine: OrtEngine) -> None:
    prompt = chat(engine, PROMPTS[2])
    undisturbed = generate(engine, prompt, 14)
    assert len(undisturbed) == 14
    driver = EngineStepper(engine)
    resumed = driver.add(prompt, SamplingParams(max_tokens=9), replay=undisturbed[:5])
    driver.add(chat(engine, PROMPTS[0]), SamplingParams(max_tokens=9))  # beside another sequence
    result = driver.run()[resumed]
    assert result.prefill_tokens == len(prompt) + 5
    assert result.tokens == undisturbed[5:]


def test_chat_turn_reuses_its_kv_even_after_being_parked(engine: OrtEngine) -> None:
    prompt = chat(engine, PROMPTS[0])
    follow = ids_of(engine, FOLLOW)

    def two_turns(park: bool) -> tuple[list[int], int]:
        driver = EngineStepper(engine)
        first = driver.add(prompt, SamplingParams(max_tokens=5), hold=True)
        said = driver.run([first])[first]
        assert said.finish == FinishReason.LENGTH and first in engine._held  # kept for the next turn
        if park:  # four other sequences need every slot: the idle chat is copied out
            together(engine, [(chat(engine, p), 3) for p in PROMPTS])
            assert engine._held[first].parked is not None and engine.kv_usage().used_bytes > 0
        second = driver.add([*prompt, *said.tokens, *follow], SamplingParams(max_tokens=5), reuse=first)
        result = driver.run([second])[second]
        assert first not in engine._held and second not in engine._held  # a turn without hold frees it
        assert result.prefill_tokens is not None
        return result.tokens, result.prefill_tokens

    kept, new_kept = two_turns(park=False)
    parked, new_parked = two_turns(park=True)
    assert new_kept == new_parked == len(follow) + 1  # the last generated token has no KV yet
    assert parked == kept


def test_a_chat_turn_stopped_early_with_a_step_past_it_continues_like_a_fresh_sequence(engine: OrtEngine) -> None:
    """A stop string found in step t stops the turn after step t+1 ran (the loop overlaps output
    processing with the next step): that step fed the turn's last token, so the next turn prefills
    only its new part, and continues as a fresh sequence over the whole context would."""
    prompt = chat(engine, PROMPTS[0])
    driver = EngineStepper(engine)
    first = driver.add(prompt, SamplingParams(max_tokens=20), hold=True)
    while len(driver.results[first].tokens) < 6:
        driver.step()
    said = driver.results[first].tokens[:5]  # the stop string ended the turn at its fifth token
    driver.stop(first, hold=True)
    follow = ids_of(engine, FOLLOW)
    context = [*prompt, *said, *follow]
    second = driver.add(context, SamplingParams(max_tokens=6), reuse=first)
    result = driver.run([second])[second]
    assert result.prefill_tokens == len(follow)  # the step past the stop fed the fifth token
    assert result.tokens == generate(engine, context, 6)


def test_seeded_sampling_gives_the_same_tokens_alone_and_batched(engine: OrtEngine) -> None:
    prompt = chat(engine, PROMPTS[2])
    sampling = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=40, seed=7)
    alone = generate(engine, prompt, 10, sampling)
    batched = together(engine, [(prompt, sampling), (prompt, 10)])
    assert batched[0] == alone
    assert generate(engine, prompt, 10, SamplingParams(max_tokens=10, temperature=0.9, seed=8)) != alone


def test_a_stop_during_prefill_frees_the_slot_at_once_and_no_model_call_runs_for_it(engine: OrtEngine) -> None:
    long_prompt = chat(engine, " ".join(PROMPTS * 4))  # chunks of 16: many steps of prefill
    assert len(long_prompt) > 4 * engine.prefill_chunk
    before = engine.kv_usage().used_bytes
    driver = EngineStepper(engine)
    seq_id = driver.add(long_prompt, SamplingParams(max_tokens=4))
    calls = engine.prefill_calls
    assert driver.step() == []  # one chunk, no token yet
    assert engine.prefill_calls == calls + 1 and engine.kv_usage().used_bytes > before
    seq = engine._live[seq_id]
    driver.stop(seq_id)
    assert seq.slot is None and seq not in engine._owners and engine.kv_usage().used_bytes == before
    assert engine.next_step_in() is None and driver.step() == []  # nothing more runs for it
    assert engine.prefill_calls == calls + 1
    # a decoding sequence stopped between two steps is freed the same way and gets no more tokens
    seq_id = driver.add(chat(engine, PROMPTS[1]), SamplingParams(max_tokens=10))
    driver.step()
    driver.step()
    driver.stop(seq_id)
    assert driver.step() == [] and len(driver.results[seq_id].tokens) == 2
    assert engine.kv_usage().used_bytes == before
    assert generate(engine, chat(engine, PROMPTS[1]), 1)  # the engine goes on
    driver.stop(123456789)  # unknown ids are ignored


def test_the_lm_head_as_built_also_keeps_greedy_tokens_independent_of_the_batch() -> None:
    engine = OrtEngine(model_paths().edge_dir, model_id="t", threads=1, max_batch=4, lm_head="nbits")
    try:
        prompts = [chat(engine, p) for p in PROMPTS]
        alone = [generate(engine, p, 10) for p in prompts]
        assert together(engine, [(p, 10) for p in prompts]) == alone
        assert all(len(set(tokens)) > 1 for tokens in alone)  # it writes text, not one repeated token
    finally:
        engine.close()


def test_adaptive_threading_switches_sessions_without_changing_a_token(engine: OrtEngine) -> None:
    prompts = [chat(engine, p) for p in PROMPTS[:3]]
    alone = [generate(engine, p, 12) for p in prompts]
    adaptive = OrtEngine(model_paths().edge_dir, model_id="t", threads=2, max_batch=4, adaptive_threading=True)
    try:
        # A chooser that moves between the three sessions (2 threads sleeping / spinning, 1 thread) all the time.
        adaptive.chooser = SessionChooser(3, probe_every=1, max_probe_every=1, probe_calls=1, window=1)
        assert [generate(adaptive, p, 12) for p in prompts] == alone
        assert together(adaptive, [(p, 12) for p in prompts]) == alone
        assert all(calls > 3 for calls in adaptive.chooser.calls), (
            adaptive.chooser.calls
        )  # every session ran decode calls
    finally:
        adaptive.close()


def test_logprobs_belong_to_each_token_alone_and_batched(engine: OrtEngine) -> None:
    sampling = SamplingParams(max_tokens=8, logprobs=True, top_logprobs=2)
    prompts = [chat(engine, p) for p in PROMPTS[:3]]
    driver = EngineStepper(engine)
    alone = driver.run([driver.add(prompts[1], sampling)])
    (single,) = alone.values()
    results = run_together(engine, [(prompts[0], 8), (prompts[1], sampling), (prompts[2], 8)])
    assert results[1].tokens == single.tokens
    for result in (single, results[1]):
        assert [entry.token_id for entry in result.logprobs] == result.tokens
        assert all(len(entry.top_ids) == 2 and entry.logprob <= 0.0 for entry in result.logprobs)
    assert [e.logprob for e in results[1].logprobs] == [e.logprob for e in single.logprobs]  # batch invariant
    assert not results[0].logprobs and not results[2].logprobs  # rows that do not ask get none


PENALISED = SamplingParams(
    max_tokens=14, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3, min_tokens=14
)


def test_penalised_rows_are_batch_invariant_and_leave_the_other_rows_alone(engine: OrtEngine) -> None:
    prompts = [chat(engine, p) for p in PROMPTS]
    plain = [generate(engine, p, 14) for p in prompts]
    penalised = generate(engine, prompts[1], 14, PENALISED)
    assert penalised != plain[1]
    assert not set(penalised) & engine.info.eos_token_ids  # min_tokens held EOS off
    runs: list[tuple[list[int], int | SamplingParams]] = [(p, 14) for p in prompts]
    runs[1] = (prompts[1], PENALISED)
    assert together(engine, runs) == [plain[0], penalised, *plain[2:]]


def test_a_resumed_penalised_stream_continues_like_the_undisturbed_run(engine: OrtEngine) -> None:
    """The replayed tokens count as generated: the penalties after the replay are the undisturbed run's."""
    prompt = chat(engine, PROMPTS[3])
    undisturbed = generate(engine, prompt, 14, PENALISED)
    rest = replace(PENALISED, max_tokens=9)  # max_tokens: new tokens; min_tokens counts the replayed ones
    resumed = EngineStepper(engine).generate(prompt, rest, replay=undisturbed[:5])
    assert resumed == undisturbed[5:]
