"""Drives an engine (the engine core contract, services/worker/types.py) synchronously from a test: what
the worker's engine loop does, without the loop thread, so engine tests can add sequences, step and
read every row's outputs deterministically.

    driver = EngineDriver(engine)
    a = driver.add(prompt_ids, SamplingParams(max_tokens=8))
    b = driver.add(other_ids, SamplingParams(max_tokens=8))
    results = driver.run()          # step until every sequence added has ended
    results[a].tokens, results[a].finish, results[a].prefill_tokens

A structured-output constraint is compiled by the driver, as the runtime does before it adds a
sequence (services/worker/runner.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.common.generation import FinishReason
from services.common.logprobs import SampledLogprobs
from services.common.sampling import SamplingParams
from services.worker.types import Engine, NewSequence, SequenceOutput

_ids = itertools.count(1_000_000)  # unique across drivers of one engine (tests share engines)


@dataclass
class Result:
    """Everything the engine output for one sequence so far."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[SampledLogprobs] = field(default_factory=list)
    finish: FinishReason | None = None
    prefill_tokens: int | None = None
    error: BaseException | None = None
    steps: int = 0
    """Outputs it had (a step with several tokens, a speculative round, counts once)."""

    @property
    def ended(self) -> bool:
        return self.finish is not None or self.error is not None


class EngineDriver:
    """One engine, stepped by the calling thread (see the module docstring)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.results: dict[int, Result] = {}
        self.steps = 0
        self._grammars: Any = None
        engine.bind(lambda: None)

    def spec(
        self,
        prompt: Sequence[int],
        sampling: SamplingParams,
        *,
        replay: Sequence[int] = (),
        fork_of: int | None = None,
        reuse: int | None = None,
        hold: bool = False,
        background: bool = False,
        tenant: str = "",
        shareable: bool = False,
        priority: int = 0,
    ) -> NewSequence:
        """A new sequence as the runtime builds it (its grammar compiled, advanced over ``replay``)."""
        constraint = None
        if sampling.structured is not None:
            constraint = self.grammars().open(sampling.structured, tuple(replay))
        return NewSequence(
            next(_ids),
            tuple(prompt),
            sampling,
            tuple(replay),
            constraint,
            tenant=tenant,
            shareable=shareable,
            priority=priority,
            background=background,
            fork_of=fork_of,
            reuse=reuse,
            hold=hold,
        )

    def grammars(self) -> Any:
        if self._grammars is None:
            from services.worker.grammar import GrammarCompiler

            info = self.engine.info
            self._grammars = GrammarCompiler(self.engine.tokenizer, info.vocab_size, info.eos_token_ids)
        return self._grammars

    def add(self, prompt: Sequence[int], sampling: SamplingParams, **options: Any) -> int:
        """Add one sequence (see :meth:`spec`); its id. A refusal raises here."""
        return self.add_spec(self.spec(prompt, sampling, **options))

    def add_spec(self, seq: NewSequence) -> int:
        self.results[seq.id] = Result()
        try:
            self.engine.add(seq)
        except BaseException:
            del self.results[seq.id]
            raise
        return seq.id

    def choices(self, prompt: Sequence[int], sampling: SamplingParams, n: int, *, forks: bool = True) -> list[int]:
        """The ``n`` choices of one prompt as the runtime adds them (choice ``i`` samples with
        ``sampling.choice(i)``; the others fork the first where the engine shares a prefill)."""
        ids: list[int] = []
        for i in range(n):
            share = forks and i > 0 and self.engine.capabilities.forks
            ids.append(self.add(prompt, sampling.choice(i), fork_of=ids[0] if share else None))
        return ids

    def stop(self, seq_id: int, hold: bool = False) -> None:
        self.engine.stop(seq_id, hold)

    def step(self) -> list[SequenceOutput]:
        """One engine step; its outputs (also folded into :attr:`results`)."""
        outputs = self.engine.step()
        self.steps += 1
        for out in outputs:
            result = self.results.setdefault(out.id, Result())
            result.steps += 1
            result.tokens += out.tokens
            if out.logprobs:
                result.logprobs += out.logprobs
            if out.prefill_tokens is not None:
                result.prefill_tokens = out.prefill_tokens
            if out.finish is not None:
                result.finish = out.finish
            if out.error is not None:
                result.error = out.error
        return outputs

    def run(self, ids: Sequence[int] | None = None, *, max_steps: int = 100_000) -> dict[int, Result]:
        """Step until every sequence of ``ids`` (default: all added) has ended; the results."""
        wanted = list(self.results) if ids is None else list(ids)
        for _ in range(max_steps):
            if all(self.results[i].ended for i in wanted):
                return {i: self.results[i] for i in wanted}
            if self.engine.next_step_in() is None:
                raise AssertionError("the engine has nothing to do but sequences have not ended")
            self.step()
        raise AssertionError(f"sequences did not end within {max_steps} steps")

    def generate(self, prompt: Sequence[int], sampling: SamplingParams, **options: Any) -> list[int]:
        """The tokens of one sequence run to its end (raises its error)."""
        seq_id = self.add(prompt, sampling, **options)
        result = self.run([seq_id])[seq_id]
        if result.error is not None:
            raise result.error
        return result.tokens

    def close(self) -> None:
        """Stop every sequence still live (the engine itself stays open)."""
        for seq_id, result in self.results.items():
            if not result.ended:
                self.engine.stop(seq_id)
        if self._grammars is not None:
            self._grammars.close()
