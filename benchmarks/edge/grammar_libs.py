"""llguidance vs outlines-core on our tokenizer: schema compile time, per-token mask time, memory.

Run: ``python -m benchmarks.edge.grammar_libs`` (each library/schema pair in its own process, so a
compile that does not finish is cut at ``--timeout`` seconds and memory is that process's RSS growth).
Prints one JSON line per pair; docs/structured_output.md holds the numbers and the choice.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import numpy as np

from services.common.model_paths import model_paths

EOS = 2  # SmolLM2-Instruct's <|im_end|>

SCHEMAS: dict[str, tuple[dict[str, Any], str]] = {
    "person": (
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        '{"name": "Ada Lovelace", "age": 36}',
    ),
    "order": (
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
                "status": {"enum": ["pending", "shipped", "delivered"]},
                "customer": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "email": {"type": "string", "format": "email"}},
                    "required": ["name", "email"],
                    "additionalProperties": False,
                },
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string"},
                            "qty": {"type": "integer", "minimum": 1},
                            "price": {"type": "number"},
                        },
                        "required": ["sku", "qty", "price"],
                        "additionalProperties": False,
                    },
                    "minItems": 1,
                },
                "note": {"type": ["string", "null"]},
            },
            "required": ["id", "status", "customer", "items", "note"],
            "additionalProperties": False,
        },
        '{"id": "ORD-123456", "status": "shipped", "customer": {"name": "Bo", "email": "bo@example.com"}, '
        '"items": [{"sku": "A1", "qty": 2, "price": 9.5}, {"sku": "B2", "qty": 1, "price": 20}], "note": null}',
    ),
}


def _large() -> tuple[dict[str, Any], str]:
    kinds = [{"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"type": "number"}]
    props = {f"field_{i}": kinds[i % 4] for i in range(200)}
    values = ['"x"', "1", "true", "2.5"]
    text = "{" + ", ".join(f'"field_{i}": {values[i % 4]}' for i in range(200)) + "}"
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}, text


def _deep(depth: int = 40) -> tuple[dict[str, Any], str]:
    schema: dict[str, Any] = {"type": "integer"}
    text = "1"
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"], "additionalProperties": False}
        text = '{"a": ' + text + "}"
    return schema, text


def _counted() -> tuple[dict[str, Any], str]:
    """Counted repetitions (vLLM #54003's kind): bounded strings and arrays expand into huge automata."""
    schema = {
        "type": "object",
        "properties": {
            "code": {"type": "string", "minLength": 10, "maxLength": 400},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 40},
        },
        "required": ["code", "tags"],
        "additionalProperties": False,
    }
    return schema, '{"code": "abcdefghijklmnop", "tags": ["a", "bb"]}'


SCHEMAS["large_200_props"] = _large()
SCHEMAS["deep_40"] = _deep()
SCHEMAS["counted_repetition"] = _counted()


def _rss() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _tokens(tokenizer_json: str, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return list(Tokenizer.from_str(tokenizer_json).encode(text, add_special_tokens=False).ids)


def run_llguidance(name: str, tokenizer_json: str, out: Any) -> None:
    import llguidance
    import llguidance.numpy as lln

    schema, text = SCHEMAS[name]
    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=49152, eos_token=EOS)
    tok_s = time.perf_counter() - t0
    base = _rss()
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
    compile_s = time.perf_counter() - t0
    assert not matcher.is_error(), matcher.get_error()
    mask = lln.allocate_token_bitmask(1, 49152)
    times = []
    ids = _tokens(tokenizer_json, text)
    first: float | None = None
    for t in ids:
        t0 = time.perf_counter()
        lln.fill_next_token_bitmask(matcher, mask, 0)
        times.append(time.perf_counter() - t0)
        first = first if first is not None else times[-1]
        assert matcher.consume_token(t), matcher.get_error()
    ok = matcher.is_accepting()
    out.put(
        dict(
            lib="llguidance",
            schema=name,
            tokenizer_s=round(tok_s, 3),
            compile_ms=round(compile_s * 1e3, 2),
            first_mask_ms=round((first if first is not None else float("nan")) * 1e3, 3),
            mask_us_median=round(statistics.median(times) * 1e6, 1),
            mask_us_p90=round(sorted(times)[int(0.9 * len(times))] * 1e6, 1),
            tokens=len(ids),
            rss_mb=round((_rss() - base) / 2**20, 1),
            accepted=ok,
        )
    )


def _byte_vocab(tokenizer_json: str) -> dict[bytes, list[int]]:
    """Token id -> bytes for a GPT-2 byte-level BPE (the inverse of ``bytes_to_unicode``)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    decode = {chr(c): b for b, c in zip(bs, cs, strict=True)}
    data = json.loads(tokenizer_json)
    special = {t["content"] for t in data.get("added_tokens", [])}
    vocab: dict[bytes, list[int]] = {}
    for token, tid in data["model"]["vocab"].items():
        if token in special or tid == EOS:
            continue
        vocab.setdefault(bytes(decode[c] for c in token), []).append(tid)
    return vocab


def run_outlines(name: str, tokenizer_json: str, out: Any) -> None:
    import outlines_core as oc

    schema, text = SCHEMAS[name]
    t0 = time.perf_counter()
    vocab = oc.Vocabulary(EOS, _byte_vocab(tokenizer_json))
    tok_s = time.perf_counter() - t0
    base = _rss()
    t0 = time.perf_counter()
    regex = oc.json_schema.build_regex_from_schema(json.dumps(schema), r"[ ]?")
    index = oc.Index(regex, vocab)
    guide = oc.Guide(index)
    compile_s = time.perf_counter() - t0
    mask = np.full((1, (49152 + 31) // 32), -1, dtype=np.int32)
    times = []
    ids = _tokens(tokenizer_json, text)
    first: float | None = None
    for t in ids:
        t0 = time.perf_counter()
        guide.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize)
        times.append(time.perf_counter() - t0)
        first = first if first is not None else times[-1]
        guide.advance(t)
    out.put(
        dict(
            lib="outlines-core",
            schema=name,
            tokenizer_s=round(tok_s, 3),
            compile_ms=round(compile_s * 1e3, 2),
            first_mask_ms=round((first if first is not None else float("nan")) * 1e3, 3),
            mask_us_median=round(statistics.median(times) * 1e6, 1),
            mask_us_p90=round(sorted(times)[int(0.9 * len(times))] * 1e6, 1),
            tokens=len(ids),
            rss_mb=round((_rss() - base) / 2**20, 1),
            regex_chars=len(regex),
            accepted=guide.is_finished(),
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--schemas", default=",".join(SCHEMAS))
    args = parser.parse_args()
    tokenizer_json = (model_paths().hf_dir / "tokenizer.json").read_text()
    ctx = mp.get_context("spawn")
    for name in args.schemas.split(","):
        for fn in (run_llguidance, run_outlines):
            q = ctx.Queue()
            p = ctx.Process(target=fn, args=(name, tokenizer_json, q))
            t0 = time.perf_counter()
            p.start()
            p.join(args.timeout)
            if p.is_alive():
                p.kill()
                p.join()
                row = {"lib": fn.__name__[4:], "schema": name, "error": f"not done after {args.timeout:g} s (killed)"}
            elif q.empty():
                row = {"lib": fn.__name__[4:], "schema": name, "error": f"exit code {p.exitcode}"}
            else:
                row = q.get()
            row["wall_s"] = round(time.perf_counter() - t0, 2)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
