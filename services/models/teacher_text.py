"""Teacher-generated training text for `meshserve distill` (``--teacher-text N``).

The teacher answers ``N`` instruction prompts built from a fixed list of topics x task kinds (no
network, no hub), through its chat template, sampled in batches with transformers ``generate`` on the
distillation device. Each sample is the whole chat turn (template tokens, prompt, answer, end of
turn), so the student learns the format the edge model is served in as well as general English.

The samples go to ``<out>/teacher-text.jsonl`` (one JSON object per sample) with the settings that
made them in ``<out>/teacher-text.json``; a later run with the same settings reuses the file (a
resumed distillation must see the same text), one with other settings stops with an error instead
of silently regenerating. The file is written atomically, so an interrupted generation leaves none.
Samples that share a run of :data:`OVERLAP_WORDS` words with a held-out evaluation text are dropped
(and counted), so no eval text reaches the training data.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)
CORPUS_FILE = "teacher-text.jsonl"
META_FILE = "teacher-text.json"
OVERLAP_WORDS = 10

TOPICS = (
    "photosynthesis", "the water cycle", "volcanoes", "black holes", "the human immune system", "vaccines",
    "plate tectonics", "climate change", "coral reefs", "honeybees", "the Roman Empire", "the printing press",
    "the Industrial Revolution", "ancient Egypt", "the Silk Road", "the French Revolution", "the Moon landing",
    "compound interest", "inflation", "supply and demand", "personal budgeting", "starting a small business",
    "learning a new language", "public speaking", "time management", "sleep hygiene", "healthy breakfast ideas",
    "running a first 5k", "houseplants", "composting", "baking bread", "making soup", "coffee brewing",
    "chess openings", "the rules of football", "how bicycles work", "electric cars", "solar panels",
    "wind turbines", "how the internet works", "email etiquette", "password security", "spreadsheets",
    "sorting algorithms", "binary numbers", "recursion", "databases", "version control with git",
    "unit testing", "Python lists", "HTTP requests", "machine learning", "prime numbers", "the Pythagorean theorem",
    "probability", "statistics in everyday life", "maps and navigation", "weather forecasts", "rainforests",
    "deserts", "mountain hiking safety", "camping", "recycling", "city parks", "libraries", "museums",
    "writing a cover letter", "job interviews", "teamwork", "giving feedback", "remote work", "friendship",
    "raising a puppy", "cats as pets", "birdwatching", "photography basics", "painting with watercolors",
    "playing the guitar", "jazz music", "the history of film", "board games", "travel packing",
    "train journeys", "airports", "first aid basics", "drinking enough water", "meditation", "volunteering",
)  # fmt: skip

TASKS = (
    "Explain {t} to a ten-year-old.",
    "Write a short paragraph about {t}.",
    "Give three interesting facts about {t}.",
    "What are the most common misconceptions about {t}?",
    "Write a short story in which {t} plays a part.",
    "Summarize the key ideas of {t} in a few sentences.",
    "List the pros and cons of {t}.",
    "Write a friendly email to a colleague about {t}.",
    "Give step-by-step advice for a beginner interested in {t}.",
    "Write a short dialogue between two friends discussing {t}.",
    "Why does {t} matter? Answer in one paragraph.",
    "Describe {t} as if writing an encyclopedia entry.",
    "Write a news-style report about a recent event involving {t}.",
    "Ask and answer five quiz questions about {t}.",
    "Compare {t} with something similar and explain the differences.",
    "Write a short poem about {t}.",
    "What questions do people often ask about {t}? Answer two of them.",
    "Write a product description or advertisement related to {t}.",
    "Explain the history of {t} briefly.",
    "Give a practical tip about {t} and explain why it works.",
)


@dataclass(frozen=True)
class TeacherTextOptions:
    """How much teacher text, and how it is sampled (``samples=0``: none)."""

    samples: int = 0
    max_new_tokens: int = 256
    temperature: float = 0.8
    top_p: float = 0.95
    batch_size: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if self.samples < 0:
            raise ValueError(f"--teacher-text must be 0 or more samples, got {self.samples}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--teacher-text-tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature <= 0:
            raise ValueError(f"--teacher-text-temperature must be above 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--teacher-text-top-p must be in (0, 1], got {self.top_p}")
        if self.batch_size < 1:
            raise ValueError(f"--teacher-text-batch must be at least 1, got {self.batch_size}")

    def settings(self, teacher: Path) -> dict[str, Any]:
        """What the file depends on (the batch size only changes padding, so it is left out)."""
        values = asdict(self)
        del values["batch_size"]
        prompt_list = hashlib.sha256("\n".join(TOPICS + TASKS).encode()).hexdigest()[:16]
        return {**values, "teacher": str(teacher.resolve()), "prompt_list": prompt_list}


def prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` prompts: every topic x task pair in a seeded order, cycling when ``n`` is larger."""
    pairs = [task.format(t=topic) for topic in TOPICS for task in TASKS]
    random.Random(seed).shuffle(pairs)
    return [pairs[i % len(pairs)] for i in range(n)]


def heldout_shingles(texts: list[str], words: int = OVERLAP_WORDS) -> set[tuple[str, ...]]:
    """Every run of ``words`` consecutive (lower-cased, punctuation-free) words in ``texts``."""
    out: set[tuple[str, ...]] = set()
    for text in texts:
        tokens = _words(text)
        out.update(tuple(tokens[i : i + words]) for i in range(len(tokens) - words + 1))
    return out


def overlaps(text: str, shingles: set[tuple[str, ...]], words: int = OVERLAP_WORDS) -> bool:
    tokens = _words(text)
    return any(tuple(tokens[i : i + words]) in shingles for i in range(len(tokens) - words + 1))


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def _heldout_texts() -> list[str]:
    from services.models.evaluate import HELDOUT

    return [HELDOUT.read_text(errors="replace")]


def ensure(
    out: Path, teacher_dir: Path, model: Any, tokenizer: Any, opts: TeacherTextOptions, show_progress: bool = True
) -> list[str]:
    """The teacher-text samples for this run: read from ``out`` when made with ``opts``, else generated."""
    if opts.samples == 0:
        return []
    corpus, meta = out / CORPUS_FILE, out / META_FILE
    wanted = opts.settings(teacher_dir)
    if corpus.is_file() and meta.is_file():
        found = json.loads(meta.read_text())
        if found.get("settings") != wanted:
            changed = sorted(k for k in wanted if found.get("settings", {}).get(k) != wanted[k])
            raise ValueError(
                f"{corpus} was generated with other settings ({', '.join(changed)} differ); "
                "pass the same --teacher-text options, or delete it (and the checkpoints) to regenerate"
            )
        log.info("teacher_text_reused", path=str(corpus), samples=found.get("samples"))
        return [json.loads(line)["text"] for line in corpus.read_text().splitlines() if line]
    if corpus.is_file():
        log.warning("teacher_text_regenerated", path=str(corpus), reason=f"{META_FILE} missing")
    samples, dropped = generate(model, tokenizer, opts, show_progress)
    out.mkdir(parents=True, exist_ok=True)
    tmp = corpus.with_name(corpus.name + ".partial")
    with open(tmp, "w") as handle:
        for sample in samples:
            handle.write(json.dumps(sample, ensure_ascii=False) + "\n")
    os.replace(tmp, corpus)
    tokens = sum(s["new_tokens"] for s in samples)
    meta.write_text(json.dumps({"settings": wanted, "samples": len(samples), "dropped": dropped, "new_tokens": tokens}))
    log.info("teacher_text_generated", path=str(corpus), samples=len(samples), dropped=dropped, new_tokens=tokens)
    return [s["text"] for s in samples]


def generate(
    model: Any, tokenizer: Any, opts: TeacherTextOptions, show_progress: bool = True
) -> tuple[list[dict[str, Any]], int]:
    """Sample the teacher's answers in batches; returns the kept samples and how many were dropped."""
    import torch
    from tqdm import tqdm

    device = next(model.parameters()).device
    shingles = heldout_shingles(_heldout_texts())
    eos = [t for t in {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")} if isinstance(t, int)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    kept: list[dict[str, Any]] = []
    dropped = 0
    todo = prompts(opts.samples, opts.seed)
    try:
        with tqdm(total=len(todo), desc="teacher text", unit="sample", disable=not show_progress) as bar:
            for start in range(0, len(todo), opts.batch_size):
                batch = todo[start : start + opts.batch_size]
                rendered = [_render(tokenizer, p) for p in batch]
                enc = tokenizer(rendered, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
                torch.manual_seed(opts.seed * 1_000_003 + start)
                with torch.no_grad():
                    ids = model.generate(
                        **enc,
                        do_sample=True,
                        temperature=opts.temperature,
                        top_p=opts.top_p,
                        top_k=0,
                        max_new_tokens=opts.max_new_tokens,
                        eos_token_id=eos,
                        pad_token_id=pad,
                    )
                new = ids[:, enc["input_ids"].shape[1] :].tolist()
                for prompt, text, row in zip(batch, rendered, new, strict=True):
                    row = row[: next((i + 1 for i, t in enumerate(row) if t in eos), len(row))]
                    answer = tokenizer.decode(row, skip_special_tokens=False)
                    if overlaps(prompt + " " + answer, shingles):
                        dropped += 1
                        continue
                    kept.append({"prompt": prompt, "text": text + answer, "new_tokens": len(row)})
                bar.update(len(batch))
    finally:
        tokenizer.padding_side = side
    return kept, dropped


def _render(tokenizer: Any, prompt: str) -> str:
    """The prompt as the teacher sees it in chat (plain text when the tokenizer has no template)."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}]
        return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return prompt + "\n"


# ------------------------------------------------------------------------------------------ CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = TeacherTextOptions()
    parser.add_argument(
        "--teacher-text",
        type=int,
        default=d.samples,
        metavar="N",
        help="also train on N answers the teacher samples for built-in instruction prompts, generated once "
        "into <out>/teacher-text.jsonl and reused (mixed with --corpus; default 0 = none)",
    )
    parser.add_argument("--teacher-text-tokens", type=int, default=d.max_new_tokens, help="max new tokens per sample")
    parser.add_argument("--teacher-text-temperature", type=float, default=d.temperature, help="(default %(default)s)")
    parser.add_argument("--teacher-text-top-p", type=float, default=d.top_p, help="(default %(default)s)")
    parser.add_argument("--teacher-text-batch", type=int, default=d.batch_size, help="prompts per generate call")
    parser.add_argument("--teacher-text-seed", type=int, default=d.seed, help="prompt order and sampling seed")


def from_args(args: argparse.Namespace) -> TeacherTextOptions:
    return TeacherTextOptions(
        samples=args.teacher_text,
        max_new_tokens=args.teacher_text_tokens,
        temperature=args.teacher_text_temperature,
        top_p=args.teacher_text_top_p,
        batch_size=args.teacher_text_batch,
        seed=args.teacher_text_seed,
    )
