"""The light tokenizer must produce exactly the ids transformers produces."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.errors import InvalidArgument
from services.common.model_paths import model_paths
from services.common.tokenizer import Tokenizer

HF_DIR = model_paths().hf_dir

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy? Ünïcödé — 東京 🚀"},
    ],
    [{"role": "user", "content": "  leading spaces\n\nand blank lines\t"}],
]
PROMPTS = ["hello world", "  The quick brown fox\njumps.", "<|im_start|>user\nhi<|im_end|>", "数学 émoji 🤖"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(HF_DIR)


@pytest.fixture(scope="module")
def hf():  # type: ignore[no-untyped-def]
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(HF_DIR))


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok: Tokenizer, hf, messages, add_generation_prompt: bool) -> None:  # type: ignore[no-untyped-def]
    expected = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    if not isinstance(expected, list):  # transformers 5 returns a BatchEncoding
        expected = list(expected["input_ids"])
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.render_chat(messages, add_generation_prompt) == text


@pytest.mark.parametrize("prompt", PROMPTS)
def test_plain_encode_matches_transformers(tok: Tokenizer, hf, prompt: str) -> None:  # type: ignore[no-untyped-def]
    # transformers' default (add_special_tokens=True) adds no BOS for this tokenizer; we match it.
    assert tok.encode(prompt) == hf(prompt)["input_ids"]
    assert tok.decode(tok.encode(prompt)) == hf.decode(hf(prompt)["input_ids"])


def test_metadata(tok: Tokenizer, hf) -> None:  # type: ignore[no-untyped-def]
    assert tok.eos_token_id == hf.eos_token_id == 2
    assert tok.vocab_size == len(hf)
    assert len(tok.fingerprint) == 32


def test_bad_role_is_invalid_argument(tok: Tokenizer) -> None:
    with pytest.raises(InvalidArgument, match="role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_missing_dir_is_config_error(tmp_path: Path) -> None:
    from services.common.errors import ConfigError

    with pytest.raises(ConfigError, match="models prepare"):
        Tokenizer(tmp_path)
