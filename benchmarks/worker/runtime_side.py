"""One side of ``meshserve bench worker-runtime``: a tree's worker runtime over a zero-cost batched
engine, in one process, printing one JSON object.

Run as a script with a source tree first on the path (``python -P runtime_side.py --tree TREE ...``),
so the tree's own ``services`` package is the one imported: this file imports nothing of the tree it
lives in, and finds which runtime the tree has:

* the engine loop (``services.worker.types.EngineCapabilities`` exists): its ``Runner`` over
  :class:`InstantBatchedEngine`, which advances every live sequence one token per ``step()`` and
  costs nothing else;
* the runtime before it (a thread per sequence blocking in ``EngineSequence.step()``): its ``Runner``
  over :class:`LockstepEngine`, whose sequences' ``step()`` all wait for one shared zero-cost batch
  step, as both real engines' did (the edge engine's batch thread, the cloud scheduler).

Both sides use the tree's own detokenizer, stop strings and events, the real SmolLM2 tokenizer, the
same token ids (ordinary word pieces, cycled) and the worker's default flush window (20 ms while 8
or more streams are open). ``--floor`` also measures a bare loop doing only the per-token work
(incremental detokenization and the stop-string check) for the same rows: the least any runtime can cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

WORDS = tuple(range(1000, 1256))
"""Ordinary word-piece ids of SmolLM2's vocabulary (ASCII words), cycled through."""


def _tokenizer(models_dir: str) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(models_dir) / "tokenizer.json"))


# --- the engine loop (this tree's runtime) ------------------------------------------------------------


def _new_side(tokenizer: Any, streams: int, tokens: int, step_s: float = 0.0) -> tuple[float, int, float]:
    from services.common.coalesce import FlushWindow
    from services.common.generation import FinishReason, GenerationRequest
    from services.common.sampling import SamplingParams
    from services.worker.runner import Runner
    from services.worker.types import Engine, EngineCapabilities, EngineInfo, NewSequence, SequenceOutput

    class InstantBatchedEngine(Engine):
        def __init__(self) -> None:
            self._info = EngineInfo("bench", tokenizer.get_vocab_size(), 1 << 20, frozenset())
            self._caps = EngineCapabilities("instant")
            self._live: dict[int, list[int]] = {}
            self.steps = 0
            self.model_s = 0.0

        @property
        def info(self) -> EngineInfo:
            return self._info

        @property
        def tokenizer(self) -> Any:
            return tokenizer

        @property
        def capabilities(self) -> EngineCapabilities:
            return self._caps

        def add(self, seq: NewSequence) -> None:
            self._live[seq.id] = [seq.prompt_ids[0], 0, seq.sampling.max_tokens]

        def stop(self, seq_id: int, hold: bool = False) -> None:
            self._live.pop(seq_id, None)

        def next_step_in(self) -> float | None:
            return 0.0 if self._live else None

        def step(self) -> list[SequenceOutput]:
            self.steps += 1
            if step_s:  # a model call's time, the GIL released as onnxruntime and torch release it
                began = time.perf_counter()
                time.sleep(step_s)
                self.model_s += time.perf_counter() - began
            outputs = []
            for seq_id, state in list(self._live.items()):
                state[1] += 1
                out = SequenceOutput(seq_id, [WORDS[(state[0] + state[1]) % len(WORDS)]])
                if state[1] == 1:
                    out.prefill_tokens = 1
                if state[1] >= state[2]:
                    out.finish = FinishReason.LENGTH
                    del self._live[seq_id]
                outputs.append(out)
            return outputs

    async def run() -> tuple[float, int, float]:
        engine = InstantBatchedEngine()
        runner = Runner(engine, max_active=256, max_queue=0, flush=FlushWindow(0.020, 8))

        async def one(i: int) -> int:
            got = 0
            request = GenerationRequest((WORDS[i % len(WORDS)],), SamplingParams(max_tokens=tokens))
            async for event in runner.turn(request).events():
                got += len(event.token_ids)
            return got

        await asyncio.gather(*(one(i) for i in range(streams)))  # warm-up
        steps, model_s = engine.steps, engine.model_s
        began = time.perf_counter()
        got = sum(await asyncio.gather(*(one(i) for i in range(streams))))
        wall = time.perf_counter() - began
        assert got == streams * tokens, f"{got} tokens, {streams * tokens} expected"
        await runner.aclose()
        return wall, engine.steps - steps, engine.model_s - model_s

    return asyncio.run(run())


# --- the runtime before the engine loop ---------------------------------------------------------------


class LockstepEngine:
    """For the runtime before the engine loop (its per-sequence ``EngineSequence`` interface): every
    sequence's ``step()`` waits for one shared zero-cost step of every live sequence, as both real
    engines' sequences waited for their batch thread."""

    def __init__(self, tokenizer: Any, model_id: str = "bench", step_s: float = 0.0) -> None:
        from services.worker.types import EngineInfo

        self._tokenizer = tokenizer
        self._step_s = step_s
        self.model_s = 0.0
        self._info = EngineInfo(model_id, tokenizer.get_vocab_size(), 1 << 20, frozenset())
        self._cv = threading.Condition()
        self._live = 0
        self._waiting: list[Any] = []
        self.steps = 0
        threading.Thread(target=self._loop, daemon=True).start()

    @property
    def info(self) -> Any:
        return self._info

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def start(self, token_ids: Any, sampling: Any, replay: Any = ()) -> Any:
        with self._cv:
            self._live += 1
        return _Seq(self, token_ids[0])

    def _submit(self, seq: Any) -> None:
        with self._cv:
            self._waiting.append(seq)
            self._cv.notify_all()

    def _close(self) -> None:
        with self._cv:
            self._live -= 1
            self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._waiting and len(self._waiting) >= self._live, timeout=0.05)
                batch, self._waiting = self._waiting, []
            if batch:
                self.steps += 1
                if self._step_s:
                    began = time.perf_counter()
                    time.sleep(self._step_s)
                    self.model_s += time.perf_counter() - began
                for seq in batch:
                    seq.ready.set()


class _Seq:
    def __init__(self, engine: LockstepEngine, first: int) -> None:
        self._engine = engine
        self._pos = first
        self.ready = threading.Event()
        self._closed = False

    def step(self) -> int:
        self.ready.clear()
        self._engine._submit(self)
        self.ready.wait()
        self._pos += 1
        return WORDS[self._pos % len(WORDS)]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._engine._close()


def _old_side(tokenizer: Any, streams: int, tokens: int, step_s: float = 0.0) -> tuple[float, int, float]:
    from services.common.coalesce import FlushWindow
    from services.common.sampling import SamplingParams
    from services.worker.runner import Runner
    from services.worker.types import GenerationRequest  # type: ignore[attr-defined]

    async def run() -> tuple[float, int, float]:
        engine = LockstepEngine(tokenizer, step_s=step_s)
        runner = Runner(engine, max_active=256, max_queue=0, flush=FlushWindow(0.020, 8))  # type: ignore[arg-type]

        async def one(i: int) -> int:
            got = 0
            request = GenerationRequest((WORDS[i % len(WORDS)],), SamplingParams(max_tokens=tokens))
            async for event in runner.turn(request).events():
                got += len(getattr(event, "token_ids", ()))
            return got

        await asyncio.gather(*(one(i) for i in range(streams)))  # warm-up
        steps, model_s = engine.steps, engine.model_s
        began = time.perf_counter()
        got = sum(await asyncio.gather(*(one(i) for i in range(streams))))
        wall = time.perf_counter() - began
        assert got == streams * tokens, f"{got} tokens, {streams * tokens} expected"
        await runner.aclose()
        return wall, engine.steps - steps, engine.model_s - model_s

    return asyncio.run(run())


# --- the floor ----------------------------------------------------------------------------------------


def _floor(tokenizer: Any, streams: int, tokens: int) -> tuple[float, int]:
    """The per-token work alone (the tree's detokenizer and stop matcher), row by row, step by step."""
    from services.worker.detokenizer import IncrementalDetokenizer
    from services.worker.stops import StopStringMatcher

    rows = [
        (IncrementalDetokenizer(tokenizer, (WORDS[i % len(WORDS)],)), StopStringMatcher(())) for i in range(streams)
    ]
    began = time.perf_counter()
    for step in range(tokens):
        for i, (detok, stops) in enumerate(rows):
            stops.feed(detok.add(WORDS[(i + step + 1) % len(WORDS)]))
    return time.perf_counter() - began, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tree", required=True)
    parser.add_argument("--tokenizer-dir", required=True)
    parser.add_argument("--streams", type=int, required=True)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--floor", action="store_true")
    parser.add_argument("--step-ms", type=float, default=0.0, help="model time per step (a GIL-free sleep)")
    args = parser.parse_args()
    sys.path.insert(0, args.tree)
    import services.worker.types as types

    tokenizer = _tokenizer(args.tokenizer_dir)
    loop = hasattr(types, "EngineCapabilities")
    side = _new_side if loop else _old_side
    runs = [side(tokenizer, args.streams, args.tokens, args.step_ms / 1000) for _ in range(args.repeats)]
    out: dict[str, Any] = {
        "runtime": "engine_loop" if loop else "thread_per_sequence",
        "runs": [{"wall_s": wall, "steps": steps, "model_s": model} for wall, steps, model in runs],
    }
    wall = statistics.median(wall for wall, _, _ in runs)
    out["tokens_per_s"] = args.streams * args.tokens / wall
    out["ms_per_step"] = wall * 1000 / statistics.median(steps for _, steps, _ in runs)
    if args.step_ms:  # what a step costs beyond its model call: wall per step minus the model's time per step
        out["overhead_ms_per_step"] = statistics.median((wall - model) * 1000 / steps for wall, steps, model in runs)
    if args.floor:
        floors = [_floor(tokenizer, args.streams, args.tokens) for _ in range(args.repeats)]
        floor = statistics.median(wall for wall, _ in floors)
        out["floor"] = {"tokens_per_s": args.streams * args.tokens / floor, "ms_per_step": floor * 1000 / args.tokens}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
