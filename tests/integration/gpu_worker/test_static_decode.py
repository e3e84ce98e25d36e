"""Static-shape decode steps (graphs.py, ``decode_graphs=on`` on CPU: the captured step without the capture)
against the eager path with the real model, stepped as the engine loop steps it: token for token, with
continuous batching, prefix blocks, Redis import, stop and the KV budget; and a Llama of other shapes
through the same code."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from benchmarks.engine_stepper import EngineStepper
from services.common.errors import ResourceExhausted
from services.common.sampling import SamplingParams
from services.gpu_worker.engine import CloudEngine
from tests.integration.gpu_worker.test_cloud_engine import STORY, encode, engine, generate, joined, model_dir

pytestmark = pytest.mark.integration
N = 8


@pytest.fixture(scope="module")
def eager() -> Iterator[CloudEngine]:
    e = engine(decode_graphs="off")
    yield e
    e.close()


@pytest.fixture(scope="module")
def static() -> Iterator[CloudEngine]:
    e = engine(decode_graphs="on", max_batch=6)
    assert e.static is not None and not e.static.capture  # the CPU runs the static step uncaptured
    yield e
    e.close()


def prompts(e: CloudEngine) -> list[list[int]]:
    texts = [
        "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
        "The capital of France is",
        STORY * 6,  # ~100 tokens: prefilled in chunks of the 64-token step budget
        "def fibonacci(n):",
        STORY * 2 + "Tell me more",
        "1, 2, 3,",
        "<|im_start|>user\nWhat is a prime number?<|im_end|>\n<|im_start|>assistant\n",
    ]
    return [encode(e, t) for t in texts]


def join_and_leave(e: CloudEngine, ids: list[list[int]]) -> list[list[int]]:
    """Sequences of different lengths and token counts: the first three join one by one while the others
    decode, the rest all at once; they finish (leave) at different steps."""
    return joined(e, ids, [N + 3 * (i % 3) for i in range(len(ids))], staggered=3)


def test_static_steps_equal_the_eager_path_token_for_token(eager: CloudEngine, static: CloudEngine) -> None:
    ids = prompts(eager)
    want = join_and_leave(eager, ids)
    assert static.static is not None
    before = static.static.steps
    got = join_and_leave(static, ids)
    assert got == want
    assert static.static.steps - before >= N  # pure decode steps ran static, mixed ones eager
    assert static.kv_usage().used_bytes == 0
    # alone, every step after the prefill is a static step of one row
    assert generate(static, ids[2], 12) == generate(eager, ids[2], 12)


def test_static_steps_reuse_local_prefix_blocks(eager: CloudEngine, static: CloudEngine) -> None:
    ids = encode(eager, STORY * 5 + "Once more:")
    want = generate(eager, ids)
    assert generate(static, ids) == want
    counters = static.prefix_counters()
    assert generate(static, ids) == want  # now its prompt's full blocks are local
    reused = static.prefix_counters()["local"] - counters["local"]
    assert reused == (len(ids) - 1) // 16 * 16


def test_prefix_imported_from_redis_under_static_steps(redis_url: str, eager: CloudEngine) -> None:
    ids = encode(eager, STORY * 8)
    want = generate(eager, ids)
    a = engine(redis_url, model_version="static-shared", decode_graphs="on")
    try:
        assert generate(a, ids) == want
        assert a.redis is not None
        a.redis.flush()
    finally:
        a.close()
    b = engine(redis_url, model_version="static-shared", decode_graphs="on")
    try:
        assert generate(b, ids) == want
        assert b.prefix_counters()["redis"] == (len(ids) - 1) // 16 * 16
    finally:
        b.close()


def test_stop_frees_kv_at_once_under_static_steps(eager: CloudEngine, static: CloudEngine) -> None:
    driver = EngineStepper(static)
    france = encode(static, "The capital of France is")
    other = driver.add(france, SamplingParams(max_tokens=40))
    driver.run_until(other)
    seq = driver.add(encode(static, STORY), SamplingParams(max_tokens=200))
    driver.run_until(seq, 2)
    driver.stop(seq)
    used = static.kv_usage().used_bytes
    assert 0 < used <= static.bytes_per_block * -(-(6 + 40) // 16)  # only the other sequence's blocks
    before = static.static.steps if static.static else 0
    done = driver.run([other])  # it goes on alone, in one-row static steps
    assert len(driver.results[seq].tokens) == 2
    assert done[other].tokens == generate(eager, france, 40)
    assert static.static is not None and static.static.steps > before
    assert static.kv_usage().used_bytes == 0


def test_the_kv_budget_holds_the_pad_block(static: CloudEngine) -> None:
    budget = 48 << 20
    total = budget // static.bytes_per_block
    assert static.blocks.num_blocks == total - 1  # one block of the budget is the padding rows' block
    cache_bytes = sum(t.numel() * t.element_size() for t in static.cache.k + static.cache.v)
    assert cache_bytes <= budget
    assert static.kv_usage().budget_bytes == static.blocks.num_blocks * static.bytes_per_block
    with pytest.raises(ResourceExhausted, match="KV budget"):
        EngineStepper(static).add([1, 2, 3], SamplingParams(max_tokens=8000))


def beside_others(e: CloudEngine, ids: list[int], sampling: SamplingParams, max_tokens: int = 30) -> list[int]:
    """``ids``' tokens while two other sequences decode in the same steps (added and decoding first)."""
    driver = EngineStepper(e)
    others = [driver.add(encode(e, t), SamplingParams(max_tokens=max_tokens)) for t in ("Hello", STORY)]
    for other in others:
        driver.run_until(other)
    try:
        return driver.generate(ids, sampling)
    finally:
        driver.close()


def test_a_seeded_sampled_stream_reproduces_in_a_batch(static: CloudEngine) -> None:
    ids = encode(static, "<|im_start|>user\nWrite a sentence about the sea.<|im_end|>\n<|im_start|>assistant\n")
    sampling = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, top_k=40, seed=1234)
    alone = generate(static, ids, sampling=sampling)
    assert len(alone) >= 3
    assert beside_others(static, ids, sampling) == alone  # the device sampler's noise: (seed, step, token) only


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Llama of other shapes (4 layers, hidden 256, 8 query / 2 KV heads) with SmolLM2's
    tokenizer, saved as an HF checkpoint."""
    out = tmp_path_factory.mktemp("llama-other")
    src = Path(model_dir())
    vocab = len(AutoTokenizer.from_pretrained(src))
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


def test_a_llama_of_other_shapes_runs_without_code_changes(other_llama: Path) -> None:
    hf = LlamaForCausalLM.from_pretrained(other_llama, dtype=torch.float32).eval()
    runs = {}
    for mode in ("off", "on"):
        e = CloudEngine(
            str(other_llama),
            model_id="llama-other",
            device="cpu",
            threads=1,
            kv_budget_bytes=8 << 20,
            decode_graphs=mode,
        )
        try:
            assert e.model.config.heads == 8 and e.model.config.kv_heads == 2 and e.model.config.head_dim == 32
            ids = [encode(e, t) for t in ("The capital of France is", STORY * 3, "def f(n):")]
            runs[mode] = joined(e, ids, [N] * len(ids), staggered=0)
        finally:
            e.close()
    assert runs["on"] == runs["off"]
    with torch.inference_mode():
        first = torch.tensor([ids[0]])
        expected = hf.generate(first, max_new_tokens=N, do_sample=False, min_new_tokens=N)[0, len(ids[0]) :]
    assert runs["off"][0] == expected.tolist()


def test_penalties_on_static_steps_equal_the_eager_path_and_ignore_the_batch(
    eager: CloudEngine, static: CloudEngine
) -> None:
    """Penalties run inside the static step (the device sampler's buffers) and on eager steps (the host
    and device samplers) with the same tokens, and a penalised row beside others decodes as alone."""
    ids = encode(static, "<|im_start|>user\nTell me about the sea.<|im_end|>\n<|im_start|>assistant\n")
    eos = min(static.info.eos_token_ids)
    plain = SamplingParams(max_tokens=24)
    penalised = SamplingParams(
        max_tokens=24,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.2,
        min_tokens=24,
        logit_bias=((eos, 5.0),),
    )
    want_plain = generate(eager, ids, sampling=plain)
    want = generate(eager, ids, sampling=penalised)
    assert want != want_plain and len(want) == 24 and eos not in want  # min_tokens held EOS off despite the bias
    assert static.static is not None
    before = static.static.steps
    assert generate(static, ids, sampling=penalised) == want
    assert static.static.steps - before >= 20
    assert beside_others(static, ids, penalised, max_tokens=40) == want


@pytest.mark.parametrize("which", ["eager", "static"])
def test_a_resumed_penalised_stream_continues_like_the_undisturbed_run(
    eager: CloudEngine, static: CloudEngine, which: str
) -> None:
    e = eager if which == "eager" else static
    ids = encode(e, "<|im_start|>user\nTell me about dogs.<|im_end|>\n<|im_start|>assistant\n")
    sampling = SamplingParams(max_tokens=16, repetition_penalty=1.3, frequency_penalty=0.5, min_tokens=16)
    undisturbed = generate(e, ids, sampling=sampling)
    assert len(undisturbed) == 16
    driver = EngineStepper(e)  # max_tokens counts new tokens: the 10 after the 6 replayed
    resumed = driver.add(ids, replace(sampling, max_tokens=10), replay=undisturbed[:6])
    result = driver.run([resumed])[resumed]
    assert result.tokens == undisturbed[6:]
    assert result.prefill_tokens == len(ids) + 6  # the prompt, then one forward per replayed token


def test_a_resumed_seeded_stream_draws_what_the_undisturbed_run_drew_on_static_steps(static: CloudEngine) -> None:
    """The device sampler's noise depends on (seed, step, token), ``step`` counting the replayed tokens: a
    seeded stream resumed on another worker continues with the undisturbed run's tokens."""
    ids = encode(static, "<|im_start|>user\nWrite a sentence about the sea.<|im_end|>\n<|im_start|>assistant\n")
    sampling = SamplingParams(max_tokens=12, temperature=0.9, top_k=40, seed=99)
    undisturbed = generate(static, ids, sampling=sampling)
    assert len(undisturbed) >= 8
    driver = EngineStepper(static)
    resumed = driver.add(ids, replace(sampling, max_tokens=len(undisturbed) - 5), replay=undisturbed[:5])
    assert driver.run([resumed])[resumed].tokens == undisturbed[5:]
