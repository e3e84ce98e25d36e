"""The og engine (one ``og.Generator`` per sequence) on the engine core contract, with the real INT4
model: sequences stepped together give their tokens alone, a chat turn prefills only its new part, a
resumed stream continues the undisturbed run, a stop frees the generator."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from benchmarks.engine_stepper import EngineStepper
from services.common.generation import FinishReason
from services.common.model_paths import model_paths
from services.common.sampling import SamplingParams
from services.edge_worker.og_engine import OgEngine

pytestmark = pytest.mark.integration
PROMPTS = ["Name three colours.", "What is the sea?", "Tell me a short story about a cat."]
FOLLOW = "<|im_end|>\n<|im_start|>user\nAnd two animals?<|im_end|>\n"


@pytest.fixture(scope="module")
def engine() -> Iterator[OgEngine]:
    engine = OgEngine(model_paths().edge_dir, model_id="t", threads=1)
    yield engine
    engine.close()


def chat(engine: OgEngine, text: str) -> list[int]:
    return list(engine.tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n").ids)


def test_sequences_stepped_together_get_their_tokens_alone(engine: OgEngine) -> None:
    prompts = [chat(engine, p) for p in PROMPTS]
    alone = [EngineStepper(engine).generate(p, SamplingParams(max_tokens=8)) for p in prompts]
    driver = EngineStepper(engine)
    seq_ids = [driver.add(p, SamplingParams(max_tokens=8)) for p in prompts]
    first = driver.step()
    assert [out.prefill_tokens for out in first] == [len(p) for p in prompts]  # the first step prefills
    results = driver.run(seq_ids)
    assert [results[i].tokens for i in seq_ids] == alone
    assert all(results[i].finish in (FinishReason.LENGTH, FinishReason.STOP) for i in seq_ids)
    sampling = SamplingParams(max_tokens=8, temperature=0.9, seed=5)
    assert EngineStepper(engine).generate(prompts[0], sampling) == EngineStepper(engine).generate(prompts[0], sampling)


def test_a_chat_turn_prefills_only_its_new_tokens(engine: OgEngine) -> None:
    prompt = chat(engine, PROMPTS[0])
    follow = list(engine.tokenizer.encode(FOLLOW).ids)
    driver = EngineStepper(engine)
    first = driver.add(prompt, SamplingParams(max_tokens=5), hold=True)
    said = driver.run([first])[first]
    assert said.finish == FinishReason.LENGTH and engine.next_step_in() is None  # held, not stepped
    second = driver.add([*prompt, *said.tokens, *follow], SamplingParams(max_tokens=4), reuse=first)
    result = driver.run([second])[second]
    assert result.prefill_tokens == len(follow) + 1  # the last generated token has no KV yet
    assert len(result.tokens) == 4


def test_a_resumed_stream_continues_the_undisturbed_run(engine: OgEngine) -> None:
    prompt = chat(engine, PROMPTS[2])
    undisturbed = EngineStepper(engine).generate(prompt, SamplingParams(max_tokens=12))
    assert len(undisturbed) == 12
    driver = EngineStepper(engine)
    resumed = driver.add(prompt, SamplingParams(max_tokens=7), replay=undisturbed[:5])
    result = driver.run([resumed])[resumed]
    assert result.prefill_tokens == len(prompt) + 5
    assert result.tokens == undisturbed[5:]


def test_a_stop_frees_the_sequence_and_the_others_go_on(engine: OgEngine) -> None:
    prompts = [chat(engine, p) for p in PROMPTS[:2]]
    plain = EngineStepper(engine).generate(prompts[1], SamplingParams(max_tokens=6))
    driver = EngineStepper(engine)
    stopped = driver.add(prompts[0], SamplingParams(max_tokens=20))
    other = driver.add(prompts[1], SamplingParams(max_tokens=6))
    driver.step()
    driver.stop(stopped)
    results = driver.run([other])
    assert results[other].tokens == plain and len(driver.results[stopped].tokens) == 1
    driver.stop(stopped)  # unknown (already freed) ids are ignored
    assert engine.next_step_in() is None


def test_a_released_model_restored_gives_the_same_greedy_tokens(engine: OgEngine) -> None:
    prompt = chat(engine, PROMPTS[0])
    before = EngineStepper(engine).generate(prompt, SamplingParams(max_tokens=8))
    engine.release_model()
    assert engine.capabilities.sleeps
    engine.restore_model()
    assert EngineStepper(engine).generate(prompt, SamplingParams(max_tokens=8)) == before
