"""The cloud engine with the real model: logits vs transformers, batching, cancel, and prefixes via real Redis."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.cloud import gpu as cloud_gpu
from services.common.errors import ResourceExhausted
from services.common.sampling import SamplingParams
from services.gpu_worker.config import GpuWorkerSettings
from services.gpu_worker.engine import CloudEngine
from services.gpu_worker.model import LlamaModel, Segment, Shard
from services.gpu_worker.prefix import RedisPrefixCache

pytestmark = pytest.mark.integration
N = 6
STORY = "The history of the river valley and the towns along it is long and full of change. "


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


def generate(e: CloudEngine, ids: list[int], n: int = N, started: threading.Event | None = None) -> list[int]:
    return cloud_gpu.generate(e, ids, n, started)  # the GPU benchmark runs these same checks on CUDA


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
        encode(cloud, "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"),
        encode(cloud, "The capital of France is"),
        encode(cloud, STORY * 6),  # ~100 tokens: prefilled in chunks of the 64-token step budget
        encode(cloud, "def fibonacci(n):"),
    ]
    alone = [generate(cloud, p) for p in prompts]
    results: list[list[int]] = [[] for _ in prompts]
    threads = []
    for i, p in enumerate(prompts):  # each joins once the previous one is decoding
        started = threading.Event()
        t = threading.Thread(target=lambda i=i, p=p, s=started: results.__setitem__(i, generate(cloud, p, N, s)))
        t.start()
        threads.append(t)
        assert started.wait(120)
    for t in threads:
        t.join(120)
    assert results == alone
    assert cloud.kv_usage().used_bytes == 0


def test_cancel_frees_kv_at_once(cloud: CloudEngine) -> None:
    ids = encode(cloud, STORY)
    seq = cloud.start(ids, SamplingParams(max_tokens=200))
    seq.step()
    seq.step()
    assert cloud.kv_usage().used_bytes > 0  # prompt + 200 tokens reserved
    steps = cloud.scheduler.steps_total
    seq.close()
    assert cloud.kv_usage().used_bytes == 0
    assert seq.state is not None and seq.state.generated <= 2 + cloud.scheduler.lookahead + 1
    assert cloud.scheduler.steps_total - steps <= 1  # at most the step in flight finished


def test_request_beyond_the_kv_budget_is_resource_exhausted(cloud: CloudEngine) -> None:
    seq = cloud.start([1, 2, 3], SamplingParams(max_tokens=8000))
    with pytest.raises(ResourceExhausted, match="KV budget"):
        seq.step()
    seq.close()


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
        assert generate(b, ids) == cold
        reusable = (len(ids) - 1) // 16 * 16
        assert b.prefix_counters() == {"computed": len(ids) - reusable, "local": 0, "redis": reusable}
        seq = b.start(ids, SamplingParams(max_tokens=2))  # again: now from B's own memory
        seq.step()
        assert seq.prefill_tokens == len(ids) - reusable
        seq.close()
        assert b.prefix_counters()["local"] == reusable
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
