"""Token texts and bytes for logprobs frames, on the real tokenizer (byte-level BPE): the bytes of a
text's tokens join to its UTF-8, a part of a character shows as ``bytes:\\xNN``, special tokens by name."""

from __future__ import annotations

from tokenizers import Tokenizer

from services.common.logprobs import SampledLogprobs
from services.common.model_paths import model_paths
from services.worker.token_texts import TokenTexts


def test_bytes_join_to_the_text_and_partial_characters_are_escaped() -> None:
    tokenizer = Tokenizer.from_file(str(model_paths().hf_dir / "tokenizer.json"))
    texts = TokenTexts(tokenizer)
    text = "Hello wörld — 日本 ok"
    ids = tokenizer.encode(text).ids
    assert b"".join(texts.get(i)[1] for i in ids).decode() == text
    shown = [texts.get(i)[0] for i in ids]
    assert shown[0] == "Hello" and any(s.startswith("bytes:\\x") for s in shown)
    eos = tokenizer.token_to_id("<|im_end|>")
    assert texts.get(eos) == ("<|im_end|>", b"<|im_end|>")
    entry = texts.entry(SampledLogprobs(ids[0], -0.5, [ids[0], eos], [-0.5, -2.0]))
    assert (entry.token, entry.logprob, [t.token for t in entry.top]) == ("Hello", -0.5, ["Hello", "<|im_end|>"])
