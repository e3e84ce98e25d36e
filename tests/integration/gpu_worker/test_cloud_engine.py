"""The cloud engine with the real model, stepped as the worker's engine loop steps it (add / step / stop):
logits vs transformers, continuous batching, chunked prefill with decode first, the KV budget, stop,
logprobs, and prefixes via real Redis loaded on the engine's I/O thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.engine_stepper import EngineStepper
from services.common.errors import ResourceExhausted
from services.common.sampling import SamplingParams
from services.gpu_worker.config import GpuWorkerSettings
from services.gpu_worker.engine import CloudEngine
from services.gpu_worker.model import LlamaModel, Segment, Shard
from services.gpu_worker.prefix import RedisPrefixCache

pytestmark = pytest.mark.integration
N = 6
STORY = "The history of the river valley and the towns along it is long and full of change. "
CHAT = "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"


def model_dir() -> str:
    return GpuWorkerSettings().check_model()


def engine(redis_url: str = "", **kw: object) -> CloudEngine:
    redis = None
    if redis_url:
        redis = RedisPrefixCache(
            redis_url, block_tokens=16, budget_bytes=64 << 20, ttl_s=60, timeout_s=2.0, max_block_bytes=8 << 20
        )
    options: dict[str, object] = dict(
        model_id="smollm2-135m-instruct",
        model_version="test",
        device="cpu",
        threads=1,
        kv_budget_bytes=48 << 20,
        max_step_tokens=64,
    )
    options.update(kw)
    return CloudEngine(model_dir(), redis=redis, **options)  # type: ignore[arg-type]


def generate(e: CloudEngine, ids: list[int], n: int = N, sampling: SamplingParams | None = None) -> list[int]:
    """Up to ``n`` tokens of ``ids`` alone (an EOS included)."""
    return EngineStepper(e).generate(ids, sampling or SamplingParams(max_tokens=n))


def joined(e: CloudEngine, prompts: list[list[int]], counts: list[int], staggered: int) -> list[list[int]]:
    """The first ``staggered`` prompts join one by one (each once the one before it decodes), the rest
    all at once; ``counts[i]`` tokens each, so they leave the batch at different steps."""
    driver = EngineStepper(e)
    ids = []
    for i, (p, n) in enumerate(zip(prompts, counts, strict=True)):
        ids.append(driver.add(p, SamplingParams(max_tokens=n)))
        if i < staggered:
            driver.run_until(ids[-1])
    done = driver.run(ids)
    return [done[i].tokens for i in ids]


@pytest.fixture(scope="module")
def cloud() -> Iterator[CloudEngine]:
    e = engine()
    yield e
    e.close()


def encode(e: CloudEngine, text: str) -> list[int]:
    return list(e.tokenizer.encode(text).ids)


def test_logits_match_transformers() -> None:
    hf = AutoModelForCausalLM.from_pretrained(model_dir(), dtype=torch.float32).eval()
    ours = LlamaModel.load(model_dir(), device=torch.device("cpu"), dtype=torch.float32)
    ids = list(range(200, 240))
    cache = ours.new_cache(4, 16, torch.float32)
    # two chunks, the second attending to the first through the paged cache
    first = ours.forward([Segment(ids[:20], 0, [2, 0, 3], all_logits=True)], cache)[0]
    second = ours.forward([Segment(ids[20:], 20, [2, 0, 3], all_logits=True)], cache)[0]
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(torch.cat([first, second]), expected, atol=2e-4, rtol=1e-4)


def test_tensor_parallel_degree_must_divide_the_heads() -> None:
    config = LlamaModel.load(model_dir(), device=torch.device("cpu"), dtype=torch.float32).config
    Shard(0, 3).check(config)
    with pytest.raises(ValueError, match="does not divide the model's 9 attention heads; use one of \\[1, 3\\]"):
        Shard(0, 2).check(config)


def test_batched_equals_single_stream(cloud: CloudEngine) -> None:
    prompts = [
        encode(cloud, CHAT),
        encode(cloud, "The capital of France is"),
        encode(cloud, STORY * 6),  # ~100 tokens: prefilled in chunks of the 64-token step budget
        encode(cloud, "def fibonacci(n):"),
    ]
    alone = [generate(cloud, p) for p in prompts]
    assert joined(cloud, prompts, [N] * 4, staggered=4) == alone  # each joins a running batch
    assert joined(cloud, prompts, [N] * 4, staggered=0) == alone  # all in one batch from the start
    assert cloud.kv_usage().used_bytes == 0


def test_a_long_prompt_prefills_in_chunks_while_a_stream_decodes_in_every_step(cloud: CloudEngine) -> None:
    driver = EngineStepper(cloud)
    stream = driver.add(encode(cloud, "The capital of France is"), SamplingParams(max_tokens=40))
    driver.run_until(stream)
    long_ids = encode(cloud, "Chunks. " + STORY * 10)  # ~170 tokens, none cached: 4 chunks
    long = driver.add(long_ids, SamplingParams(max_tokens=2))
    prefill_steps = 0
    while not driver.results[long].tokens:
        before = len(driver.results[stream].tokens)
        driver.step()
        prefill_steps += 1
        assert len(driver.results[stream].tokens) == before + 1  # decode first: it never stalls
    assert prefill_steps >= 3  # chunks of at most 63 tokens beside the decode row, cut to whole blocks
    assert driver.results[long].prefill_tokens == len(long_ids)
    done = driver.run([stream, long])
    assert done[long].tokens == generate(cloud, long_ids, 2)
    assert done[stream].tokens == generate(cloud, encode(cloud, "The capital of France is"), 40)
    assert cloud.kv_usage().used_bytes == 0


def test_stop_frees_kv_at_once_and_the_sequence_is_never_stepped_again(cloud: CloudEngine) -> None:
    driver = EngineStepper(cloud)
    seq = driver.add(encode(cloud, STORY), SamplingParams(max_tokens=200))
    driver.run_until(seq, 2)
    assert cloud.kv_usage().used_bytes > 0  # prompt + 200 tokens reserved
    driver.stop(seq)
    assert cloud.kv_usage().used_bytes == 0  # before any further step
    assert cloud.next_step_in() is None  # nothing left to step
    other = driver.add(encode(cloud, "def f(n):"), SamplingParams(max_tokens=3))
    driver.run([other])
    assert len(driver.results[seq].tokens) == 2 and not driver.results[seq].ended


def test_a_stop_during_a_long_prefill_ends_it_after_the_chunk_in_flight(cloud: CloudEngine) -> None:
    ids = encode(cloud, "river stone cloud " * 100)  # ~300 tokens: 5 chunks
    driver = EngineStepper(cloud)
    seq = driver.add(ids, SamplingParams(max_tokens=4))
    steps = cloud.scheduler.steps_total
    driver.step()  # the first chunk
    assert cloud.kv_usage().used_bytes > 0
    driver.stop(seq)
    assert cloud.kv_usage().used_bytes == 0 and cloud.next_step_in() is None
    assert cloud.scheduler.steps_total - steps == 1 and not driver.results[seq].tokens


def test_request_beyond_the_kv_budget_is_resource_exhausted_when_added(cloud: CloudEngine) -> None:
    driver = EngineStepper(cloud)
    with pytest.raises(ResourceExhausted, match="KV budget"):
        driver.add([1, 2, 3], SamplingParams(max_tokens=8000))
    assert cloud.next_step_in() is None and cloud.kv_usage().used_bytes == 0


def test_admission_waits_for_kv_blocks_higher_priority_first() -> None:
    small = engine(kv_budget_bytes=10 * 368_640)  # 10 blocks of 16 tokens (30 layers x 3 KV heads x 64, fp16)
    try:
        assert small.blocks.num_blocks == 10

        def filling(ids: list[int], blocks: int) -> SamplingParams:  # prompt + max_tokens = whole blocks
            return SamplingParams(max_tokens=blocks * 16 - len(ids))

        a, low, high = encode(small, CHAT), encode(small, "Hello"), encode(small, "1, 2, 3,")
        plan = {"a": (a, filling(a, 5)), "low": (low, filling(low, 4)), "high": (high, filling(high, 4))}
        alone = {name: EngineStepper(small).generate(ids, sampling) for name, (ids, sampling) in plan.items()}
        driver = EngineStepper(small)
        first = driver.add(*plan["a"])  # 5 blocks of 10
        driver.run_until(first)
        waits = driver.add(*plan["low"], priority=0)
        jumps = driver.add(*plan["high"], priority=5)  # arrives later, admitted first
        driver.step()
        assert driver.results[jumps].tokens and not driver.results[waits].tokens  # 9 of 10 blocks held
        done = driver.run([first])  # then its 5 blocks come back: the waiting one is admitted
        driver.run_until(waits)
        done = driver.run([first, waits, jumps])
        assert [done[i].tokens for i in (first, waits, jumps)] == [alone["a"], alone["low"], alone["high"]]
        assert small.kv_usage().used_bytes == 0
    finally:
        small.close()


def test_greedy_logprobs_name_the_chosen_token_as_the_most_likely(cloud: CloudEngine) -> None:
    driver = EngineStepper(cloud)
    seq = driver.add(encode(cloud, CHAT), SamplingParams(max_tokens=6, logprobs=True, top_logprobs=3))
    result = driver.run([seq])[seq]
    assert result.tokens == generate(cloud, encode(cloud, CHAT))
    assert len(result.logprobs) == len(result.tokens)
    for token, entry in zip(result.tokens, result.logprobs, strict=True):
        assert entry.token_id == token and len(entry.top_ids) == 3 and entry.top_ids[0] == token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0]) and entry.logprob <= 0.0


def test_prefix_exported_by_a_is_imported_by_b(redis_url: str, cloud: CloudEngine) -> None:
    ids = encode(cloud, STORY * 8)  # ~130 tokens: 8 full blocks, the first 8 reusable
    cold = generate(cloud, ids)  # another model_version: a scope of its own, cold
    a = engine(redis_url, model_version="shared")
    try:
        assert generate(a, ids) == cold
        assert a.prefix_counters() == {"computed": len(ids), "local": 0, "redis": 0}
        assert a.redis is not None
        a.redis.flush()
    finally:
        a.close()
    b = engine(redis_url, model_version="shared")
    try:
        driver = EngineStepper(b)
        first = driver.add(ids, SamplingParams(max_tokens=N))  # loaded from Redis on b's I/O thread
        assert driver.run([first])[first].tokens == cold
        reusable = (len(ids) - 1) // 16 * 16
        assert driver.results[first].prefill_tokens == len(ids) - reusable
        assert b.prefix_counters() == {"computed": len(ids) - reusable, "local": 0, "redis": reusable}
        again = driver.add(ids, SamplingParams(max_tokens=2))  # now from b's own memory
        driver.run([again])
        assert driver.results[again].prefill_tokens == len(ids) - reusable
        assert b.prefix_counters()["local"] == reusable
    finally:
        b.close()


def test_the_loop_steps_other_sequences_while_a_prefix_loads_from_redis(
    redis_url: str, cloud: CloudEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = encode(cloud, STORY * 4)
    a = engine(redis_url, model_version="io-thread")
    try:
        generate(a, ids, 2)  # a exports the prompt's blocks on finish
        assert a.redis is not None
        a.redis.flush()
    finally:
        a.close()
    b = engine(redis_url, model_version="io-thread")
    try:
        assert b.redis is not None
        gate, loading = threading.Event(), threading.Event()
        load = b.redis.load

        def slow_load(*args: object) -> object:
            loading.set()
            assert gate.wait(60)
            return load(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(b.redis, "load", slow_load)
        driver = EngineStepper(b)
        waiting = driver.add(ids, SamplingParams(max_tokens=N))
        assert loading.wait(60)
        other = driver.add(encode(b, "The capital of France is"), SamplingParams(max_tokens=4))
        done = driver.run([other])  # the loop never waits on the network
        assert done[other].tokens == generate(cloud, encode(cloud, "The capital of France is"), 4)
        assert not driver.results[waiting].tokens and b.next_step_in() is None
        gate.set()  # the load ends: the I/O thread wakes the loop, the sequence is admitted
        assert driver.run([waiting])[waiting].tokens == generate(cloud, ids)
        assert b.prefix_counters()["redis"] == (len(ids) - 1) // 16 * 16

        # Stopped while its blocks load: freed now, never admitted when the load ends.
        gate.clear()
        loading.clear()
        stopped = driver.add(encode(b, "Tell me more. " + STORY * 4), SamplingParams(max_tokens=N))
        assert loading.wait(60)
        driver.stop(stopped)
        gate.set()
        driver.wait_for_work()  # the hand-over wakes the loop; the step drops it
        assert driver.step() == [] and b.next_step_in() is None and b.kv_usage().used_bytes == 0
    finally:
        b.close()


def test_redis_down_is_a_miss_not_a_failure(cloud: CloudEngine) -> None:
    ids = encode(cloud, STORY * 3)
    down = engine("redis://127.0.0.1:1/0", model_version="down")
    try:
        assert generate(down, ids) == generate(cloud, ids)
        assert down.prefix_counters()["redis"] == 0
    finally:
        down.close()
