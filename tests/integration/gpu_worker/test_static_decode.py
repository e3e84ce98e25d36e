"""Static-shape decode steps (graphs.py, ``decode_graphs=on`` on CPU: the captured step without the capture)
against today's eager path with the real model: token for token, with continuous batching, prefix blocks,
Redis import, cancellation and the KV budget; and a Llama of other shapes through the same code."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from benchmarks.cloud import gpu as cloud_gpu
from services.common.errors import ResourceExhausted
from services.common.sampling import SamplingParams
from services.gpu_worker.engine import CloudEngine
from tests.integration.gpu_worker.test_cloud_engine import STORY, encode, engine, generate, model_dir

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
    results: list[list[int]] = [[] for _ in ids]
    threads = []
    for i, p in enumerate(ids):
        started = threading.Event()
        n = N + 3 * (i % 3)
        t = threading.Thread(target=lambda i=i, p=p, n=n, s=started: results.__setitem__(i, generate(e, p, n, s)))
        t.start()
        threads.append(t)
        if i < 3:
            assert started.wait(120)
    for t in threads:
        t.join(300)
    return results


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


def test_cancel_frees_kv_at_once_under_static_steps(static: CloudEngine) -> None:
    other = static.start(encode(static, "The capital of France is"), SamplingParams(max_tokens=40))
    other.step()
    seq = static.start(encode(static, STORY), SamplingParams(max_tokens=200))
    seq.step()
    seq.step()
    steps = static.scheduler.steps_total
    seq.close()
    assert seq.state is not None and seq.state.generated <= 2 + static.scheduler.lookahead + 1
    assert static.scheduler.steps_total - steps <= 1  # at most the step in flight finished
    used = static.kv_usage().used_bytes
    assert 0 < used <= static.bytes_per_block * -(-(6 + 40) // 16)  # only the other sequence's blocks
    for _ in range(5):
        other.step()  # it goes on alone
    other.close()
    assert static.kv_usage().used_bytes == 0


def test_the_kv_budget_holds_the_pad_block(static: CloudEngine) -> None:
    budget = 48 << 20
    total = budget // static.bytes_per_block
    assert static.blocks.num_blocks == total - 1  # one block of the budget is the padding rows' block
    cache_bytes = sum(t.numel() * t.element_size() for t in static.cache.k + static.cache.v)
    assert cache_bytes <= budget
    assert static.kv_usage().budget_bytes == static.blocks.num_blocks * static.bytes_per_block
    seq = static.start([1, 2, 3], SamplingParams(max_tokens=8000))
    with pytest.raises(ResourceExhausted, match="KV budget"):
        seq.step()
    seq.close()


def test_a_seeded_sampled_stream_reproduces_in_a_batch(static: CloudEngine) -> None:
    ids = encode(static, "<|im_start|>user\nWrite a sentence about the sea.<|im_end|>\n<|im_start|>assistant\n")
    sampling = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, top_k=40, seed=1234)

    def run() -> list[int]:
        seq = static.start(ids, sampling)
        out: list[int] = []
        try:
            while len(out) < 10 and not (out and out[-1] in static.info.eos_token_ids):
                out.append(seq.step())
            return out
        finally:
            seq.close()

    alone = run()
    assert len(alone) >= 3
    others = [static.start(encode(static, t), SamplingParams(max_tokens=30)) for t in ("Hello", STORY)]
    try:
        for o in others:
            o.step()
        assert run() == alone  # the device sampler's noise depends on (seed, step, token) only
    finally:
        for o in others:
            o.close()


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
            runs[mode] = cloud_gpu.concurrent(e, ids, N)
        finally:
            e.close()
    assert runs["on"] == runs["off"]
    with torch.inference_mode():
        first = torch.tensor([ids[0]])
        expected = hf.generate(first, max_new_tokens=N, do_sample=False, min_new_tokens=N)[0, len(ids[0]) :]
    assert runs["off"][0] == expected.tolist()


def _run(e: CloudEngine, ids: list[int], sampling: SamplingParams) -> list[int]:
    seq = e.start(ids, sampling)
    out: list[int] = []
    try:
        while len(out) < sampling.max_tokens and not (out and out[-1] in e.info.eos_token_ids):
            out.append(seq.step())
        return out
    finally:
        seq.close()


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
    want_plain = _run(eager, ids, plain)
    want = _run(eager, ids, penalised)
    assert want != want_plain and len(want) == 24 and eos not in want  # min_tokens held EOS off despite the bias
    assert static.static is not None
    before = static.static.steps
    assert _run(static, ids, penalised) == want
    assert static.static.steps - before >= 20
    others = [static.start(encode(static, t), SamplingParams(max_tokens=40)) for t in ("Hello", STORY)]
    try:
        for o in others:
            o.step()
        assert _run(static, ids, penalised) == want
    finally:
        for o in others:
            o.close()


@pytest.mark.parametrize("which", ["eager", "static"])
def test_a_resumed_penalised_stream_continues_like_the_undisturbed_run(
    eager: CloudEngine, static: CloudEngine, which: str
) -> None:
    e = eager if which == "eager" else static
    ids = encode(e, "<|im_start|>user\nTell me about dogs.<|im_end|>\n<|im_start|>assistant\n")
    sampling = SamplingParams(max_tokens=16, repetition_penalty=1.3, frequency_penalty=0.5, min_tokens=16)
    undisturbed = _run(e, ids, sampling)
    seq = e.start(ids, sampling, replay=undisturbed[:6])
    try:
        assert [seq.step() for _ in range(10)] == undisturbed[6:]
    finally:
        seq.close()
