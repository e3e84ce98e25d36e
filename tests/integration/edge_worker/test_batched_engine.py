"""The batched edge engine on the real INT4 model: batch invariance, replay, chats, parking, sampling."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import onnxruntime_genai as og
import pytest
from prometheus_client import REGISTRY

from services.common.model_paths import model_paths
from services.common.sampling import SamplingParams
from services.edge_worker.batched import BatchedEngine
from services.edge_worker.sequence import BatchedSequence
from services.edge_worker.spin import SessionChooser

pytestmark = pytest.mark.integration
PROMPTS = ["Name three colours.", "What is the sea?", "Tell me a short story about a cat.", "Count to five."]


@pytest.fixture(scope="module")
def engine() -> Iterator[BatchedEngine]:
    # A small first KV capacity and prefill chunk, so growth and chunking run too.
    engine = BatchedEngine(
        model_paths().edge_dir, model_id="t", threads=1, max_batch=4, kv_capacity=16, prefill_chunk=16
    )
    yield engine
    engine.close()


def chat(engine: BatchedEngine, text: str) -> list[int]:
    ids = engine.tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n").ids
    return list(ids)


def steps(seq: BatchedSequence, n: int) -> list[int]:
    return [seq.step() for _ in range(n)]


def generate(engine: BatchedEngine, ids: list[int], n: int, sampling: SamplingParams | None = None) -> list[int]:
    seq = engine.start(ids, sampling or SamplingParams(max_tokens=n))
    try:
        return steps(seq, n)
    finally:
        seq.close()


def together(jobs: list[Callable[[], list[int]]]) -> list[list[int]]:
    """Run the jobs on threads at once (as the worker runtime does), results in job order."""
    results: list[list[int] | BaseException] = [[] for _ in jobs]

    def run(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except BaseException as exc:  # re-raised below, in the test's thread
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return [r for r in results if not isinstance(r, BaseException)]


def test_greedy_tokens_do_not_depend_on_what_shares_the_batch(engine: BatchedEngine) -> None:
    prompts = [chat(engine, p) for p in PROMPTS]
    alone = [generate(engine, p, 12) for p in prompts]
    rows_before, steps_before = engine.rows, engine.steps
    # Six at once on four slots: batches of different sizes and members, two sequences queue.
    both = together([lambda p=p: generate(engine, p, 12) for p in [*prompts, *prompts[:2]]])
    assert both == [*alone, *alone[:2]]
    assert engine.rows - rows_before > engine.steps - steps_before  # some decode calls had several rows


def test_new_prompts_of_one_length_share_a_prefill_call_and_decode_as_they_do_alone(engine: BatchedEngine) -> None:
    prompts = [chat(engine, p)[:5] for p in PROMPTS]  # four different prompts of five tokens
    blocker = chat(engine, " ".join(PROMPTS * 4))  # a long prompt: chunks of 16, one call each
    alone = [generate(engine, p, 8) for p in prompts]
    calls, rows = engine.prefill_calls, engine.prefill_rows
    metric_calls, metric_rows = prefill_metrics()
    # While the long prompt prefills, the four queue up and are taken in one round: 3 x 5 tokens
    # fill one call (at most prefill_chunk tokens), the fourth gets the next.
    first = threading.Thread(target=generate, args=(engine, blocker, 2))
    first.start()
    time.sleep(0.05)
    got = together([lambda p=p: generate(engine, p, 8) for p in prompts])
    first.join(timeout=60)
    assert got == alone
    assert engine.prefill_rows - rows > engine.prefill_calls - calls  # some call prefilled several prompts
    after_calls, after_rows = prefill_metrics()  # meshserve_edge_model_{calls,rows}_total{kind="prefill"}
    assert after_calls - metric_calls == engine.prefill_calls - calls
    assert after_rows - metric_rows == engine.prefill_rows - rows


def prefill_metrics() -> tuple[float, float]:
    calls = REGISTRY.get_sample_value("meshserve_edge_model_calls_total", {"kind": "prefill"})
    rows = REGISTRY.get_sample_value("meshserve_edge_model_rows_total", {"kind": "prefill"})
    assert calls is not None and rows is not None
    return calls, rows


def test_first_token_equals_onnxruntime_genai(engine: BatchedEngine) -> None:
    model = og.Model(str(model_paths().edge_dir))
    for text in PROMPTS[:2]:
        ids = chat(engine, text)
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + 1, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        generator.generate_next_token()
        assert generate(engine, ids, 1) == [int(generator.get_next_tokens()[0])]


def test_replayed_tokens_continue_exactly_like_the_undisturbed_run(engine: BatchedEngine) -> None:
    prompt = chat(engine, PROMPTS[2])
    undisturbed = generate(engine, prompt, 14)
    resumed = engine.start(prompt, SamplingParams(max_tokens=9), replay=undisturbed[:5])
    assert resumed.prefill_tokens == len(prompt) + 5
    try:
        other = chat(engine, PROMPTS[0])
        got, _ = together([lambda: steps(resumed, 9), lambda: generate(engine, other, 9)])
    finally:
        resumed.close()
    assert got == undisturbed[5:]


def test_chat_turn_reuses_its_kv_even_after_being_parked(engine: BatchedEngine) -> None:
    prompt = chat(engine, PROMPTS[0])
    follow = list(engine.tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnd two animals?<|im_end|>\n").ids)

    def two_turns(park: bool) -> tuple[list[int], int]:
        seq = engine.start_chat(prompt, SamplingParams(max_tokens=5))
        try:
            first = steps(seq, 5)
            if park:  # four other sequences need every slot: the idle chat is copied out
                together([lambda p=p: generate(engine, chat(engine, p), 3) for p in PROMPTS])
                assert seq.parked is not None and engine.kv_usage().used_bytes > 0
            assert seq.reuse([*prompt, *first, *follow], SamplingParams(max_tokens=5))
            new = seq.prefill_tokens
            return steps(seq, 5), new
        finally:
            seq.close()

    kept, new_kept = two_turns(park=False)
    parked, new_parked = two_turns(park=True)
    assert new_kept == new_parked == len(follow) + 1  # the last generated token has no KV yet
    assert parked == kept


def test_seeded_sampling_gives_the_same_tokens_alone_and_batched(engine: BatchedEngine) -> None:
    prompt = chat(engine, PROMPTS[2])
    sampling = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=40, seed=7)
    alone = generate(engine, prompt, 10, sampling)
    batched = together([lambda: generate(engine, prompt, 10, sampling), lambda: generate(engine, prompt, 10)])
    assert batched[0] == alone
    assert generate(engine, prompt, 10, SamplingParams(max_tokens=10, temperature=0.9, seed=8)) != alone


def test_a_closed_sequence_refuses_to_step_and_frees_its_kv(engine: BatchedEngine) -> None:
    seq = engine.start(chat(engine, PROMPTS[1]), SamplingParams(max_tokens=2))
    seq.step()
    seq.close()
    with pytest.raises(RuntimeError):
        seq.step()
    assert generate(engine, chat(engine, PROMPTS[1]), 1)  # the engine goes on
    assert seq.slot is None and seq.parked is None


def test_the_lm_head_as_built_also_keeps_greedy_tokens_independent_of_the_batch() -> None:
    engine = BatchedEngine(model_paths().edge_dir, model_id="t", threads=1, max_batch=4, lm_head="nbits")
    try:
        prompts = [chat(engine, p) for p in PROMPTS]
        alone = [generate(engine, p, 10) for p in prompts]
        assert together([lambda p=p: generate(engine, p, 10) for p in prompts]) == alone
        assert all(len(set(tokens)) > 1 for tokens in alone)  # it writes text, not one repeated token
    finally:
        engine.close()


def test_adaptive_threading_switches_sessions_without_changing_a_token(engine: BatchedEngine) -> None:
    prompts = [chat(engine, p) for p in PROMPTS[:3]]
    alone = [generate(engine, p, 12) for p in prompts]
    adaptive = BatchedEngine(model_paths().edge_dir, model_id="t", threads=2, max_batch=4, adaptive_threading=True)
    try:
        # A chooser that moves between the three sessions (2 threads sleeping / spinning, 1 thread) all the time.
        adaptive.chooser = SessionChooser(3, probe_every=1, max_probe_every=1, probe_calls=1, window=1)
        assert [generate(adaptive, p, 12) for p in prompts] == alone
        assert together([lambda p=p: generate(adaptive, p, 12) for p in prompts]) == alone
        assert all(calls > 3 for calls in adaptive.chooser.calls), (
            adaptive.chooser.calls
        )  # every session ran decode calls
    finally:
        adaptive.close()


PENALISED = SamplingParams(
    max_tokens=14, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3, min_tokens=14
)


def test_penalised_rows_are_batch_invariant_and_leave_the_other_rows_alone(engine: BatchedEngine) -> None:
    prompts = [chat(engine, p) for p in PROMPTS]
    plain = [generate(engine, p, 14) for p in prompts]
    penalised = generate(engine, prompts[1], 14, PENALISED)
    assert penalised != plain[1]
    assert not set(penalised) & engine.info.eos_token_ids  # min_tokens held EOS off
    jobs = [lambda p=p: generate(engine, p, 14) for p in prompts]
    jobs[1] = lambda: generate(engine, prompts[1], 14, PENALISED)
    got = together(jobs)
    assert got == [plain[0], penalised, *plain[2:]]


def test_a_resumed_penalised_stream_continues_like_the_undisturbed_run(engine: BatchedEngine) -> None:
    """The replayed tokens count as generated: the penalties after the replay are the undisturbed run's."""
    prompt = chat(engine, PROMPTS[3])
    undisturbed = generate(engine, prompt, 14, PENALISED)
    resumed = engine.start(prompt, PENALISED, replay=undisturbed[:5])
    try:
        assert steps(resumed, 9) == undisturbed[5:]
    finally:
        resumed.close()
