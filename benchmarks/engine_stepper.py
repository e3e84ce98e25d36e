"""Steps an engine (the engine core contract, services/worker/types.py) synchronously in the calling
thread: what the worker's engine loop does (services/worker/loop.py: add and stop between steps,
``step()`` back to back while there is work, sleeping until the engine's wake-up when it has none),
without its thread or the runtime's output processing. Engine tests read every sequence's outputs
deterministically; in-process benchmarks time the engine alone (every token is time-stamped).

    stepper = EngineStepper(engine)
    a = stepper.add(prompt_ids, SamplingParams(max_tokens=8))
    b = stepper.add(other_ids, SamplingParams(max_tokens=8))
    results = stepper.run()          # step until every sequence added has ended
    results[a].tokens, results[a].finish, results[a].prefill_tokens, results[a].ttft

A structured-output constraint is compiled here, as the runtime does before it adds a sequence
(services/worker/runner.py). The engine's wake-up matters for work it does on its own thread (the
cloud engine loads a prompt's Redis prefix blocks on its I/O thread): meanwhile it may have nothing
to step (``next_step_in() is None``) and a step waits, bounded, for the wake-up.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.common.generation import FinishReason
from services.common.logprobs import SampledLogprobs
from services.common.sampling import SamplingParams
from services.worker.types import Engine, NewSequence, SequenceOutput

if TYPE_CHECKING:
    from services.worker.grammar import GrammarCompiler

_ids = itertools.count(1_000_000)  # unique across steppers of one engine (tests share engines)


@dataclass
class SequenceResult:
    """Everything the engine output for one sequence so far, and when (``time.perf_counter``)."""

    added: float = field(default_factory=time.perf_counter)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[SampledLogprobs] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)
    """One per token (the tokens of one output share its stamp)."""
    finish: FinishReason | None = None
    prefill_tokens: int | None = None
    error: BaseException | None = None
    steps: int = 0
    """Outputs it had (a step with several tokens, a speculative round, counts once)."""
    stopped: bool = False
    """:meth:`EngineStepper.stop` ended it (the engine gives no output for that)."""

    @property
    def ended(self) -> bool:
        """It finished or failed."""
        return self.finish is not None or self.error is not None

    @property
    def ttft(self) -> float:
        """Seconds from its add to its first token."""
        return self.stamps[0] - self.added


class EngineStepper:
    """One engine, stepped by the calling thread (see the module docstring). ``grammars``: a compiler
    to share between steppers (kept open); by default one of its own, made at the first constraint."""

    def __init__(
        self, engine: Engine, *, grammars: GrammarCompiler | None = None, idle_timeout_s: float = 60.0
    ) -> None:
        self.engine = engine
        self.results: dict[int, SequenceResult] = {}
        self.steps = 0
        self.idle_timeout_s = idle_timeout_s
        self._grammars = grammars
        self._own_grammars = grammars is None
        self._woken = threading.Event()
        engine.bind(self._woken.set)

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
            constraint = self._compiler().open(sampling.structured, tuple(replay))
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

    def _compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            from services.worker.grammar import GrammarCompiler

            info = self.engine.info
            tokenizer = self.engine.tokenizer  # a tokenizers.Tokenizer, as the runtime's (runner.py)
            self._grammars = GrammarCompiler(tokenizer, info.vocab_size, info.eos_token_ids)  # type: ignore[arg-type]
        return self._grammars

    def add(self, prompt: Sequence[int], sampling: SamplingParams, **options: Any) -> int:
        """Add one sequence (``options``: those of :meth:`spec`); its id. A refusal (e.g.
        ResourceExhausted beyond the KV budget) raises here."""
        return self.add_spec(self.spec(prompt, sampling, **options))

    def add_spec(self, seq: NewSequence) -> int:
        """Add a sequence built already (e.g. by :meth:`spec`); its id. A refusal raises here."""
        self.results[seq.id] = SequenceResult()
        try:
            self.engine.add(seq)
        except BaseException:
            del self.results[seq.id]
            raise
        return seq.id

    def choices(self, prompt: Sequence[int], sampling: SamplingParams, n: int) -> list[int]:
        """The ``n`` choices of one prompt as the runtime adds them (choice ``i`` samples with
        ``sampling.choice(i)``; the others fork the first where the engine declares forks)."""
        ids: list[int] = []
        for i in range(n):
            share = i > 0 and self.engine.capabilities.forks
            ids.append(self.add(prompt, sampling.choice(i), fork_of=ids[0] if share else None))
        return ids

    def stop(self, seq_id: int, hold: bool = False) -> None:
        """End a sequence now (its KV freed at once, or kept with ``hold`` for a later ``reuse``); its
        result stays as it was, marked ``stopped``."""
        self.engine.stop(seq_id, hold)
        result = self.results.get(seq_id)
        if result is not None:
            result.stopped = True

    def wait_for_work(self) -> None:
        """Until the engine has a step to run now: through a delay it asks for (held batch lines) and,
        while it has nothing, for its wake-up (RuntimeError after ``idle_timeout_s`` without one)."""
        while True:
            self._woken.clear()  # before asking: a wake-up after the answer is kept
            wait = self.engine.next_step_in()
            if wait is not None and wait <= 0:
                return
            if not self._woken.wait(self.idle_timeout_s if wait is None else wait) and wait is None:
                raise RuntimeError(f"the engine had nothing to do for {self.idle_timeout_s} s")

    def step(self) -> list[SequenceOutput]:
        """One engine step, first waiting (:meth:`wait_for_work`) if the engine has nothing to do
        while sequences are live (a delay it asks for is not waited out: the step runs now); its
        outputs (also folded into :attr:`results`)."""
        if self.engine.next_step_in() is None and any(not r.ended and not r.stopped for r in self.results.values()):
            self.wait_for_work()
        return self._step()

    def _step(self) -> list[SequenceOutput]:
        outputs = self.engine.step()
        self.steps += 1
        now = time.perf_counter()
        for out in outputs:
            result = self.results.setdefault(out.id, SequenceResult())
            result.steps += 1
            result.tokens += out.tokens
            result.stamps += [now] * len(out.tokens)
            if out.logprobs:
                result.logprobs += out.logprobs
            if out.prefill_tokens is not None:
                result.prefill_tokens = out.prefill_tokens
            if out.finish is not None:
                result.finish = out.finish
            if out.error is not None:
                result.error = out.error
        return outputs

    def run(
        self,
        ids: Sequence[int] | None = None,
        *,
        raise_errors: bool = False,
        after_step: Callable[[], None] | None = None,
        max_steps: int = 100_000,
    ) -> dict[int, SequenceResult]:
        """Step until every sequence of ``ids`` (default: all added) has ended or was stopped, waiting
        as the engine loop does (:meth:`wait_for_work`); their results. ``raise_errors``: a failed
        sequence's error is raised instead; ``after_step`` is called after every step."""
        wanted = list(self.results) if ids is None else list(ids)
        for _ in range(max_steps):
            results = [self.results[i] for i in wanted]
            if raise_errors:
                for result in results:
                    if result.error is not None:
                        raise result.error
            if all(r.ended or r.stopped for r in results):
                return dict(zip(wanted, results, strict=True))
            self.wait_for_work()
            self._step()
            if after_step is not None:
                after_step()
        raise RuntimeError(f"sequences did not end within {max_steps} steps")

    def run_until(self, seq_id: int, tokens: int = 1, *, max_steps: int = 100_000) -> SequenceResult:
        """Step until sequence ``seq_id`` has ``tokens`` tokens (or ended); its result."""
        result = self.results[seq_id]
        for _ in range(max_steps):
            if len(result.tokens) >= tokens or result.ended:
                return result
            self.wait_for_work()
            self._step()
        raise RuntimeError(f"sequence {seq_id} did not get {tokens} tokens within {max_steps} steps")

    def generate(self, prompt: Sequence[int], sampling: SamplingParams, **options: Any) -> list[int]:
        """The tokens of one sequence run to its end (an EOS included), stepping every live one; its
        error is raised."""
        seq_id = self.add(prompt, sampling, **options)
        return self.run([seq_id], raise_errors=True)[seq_id].tokens

    def close(self) -> None:
        """Stop every sequence still live and close a compiler of its own (the engine stays open)."""
        for seq_id, result in self.results.items():
            if not result.ended and not result.stopped:
                self.stop(seq_id)
        if self._own_grammars and self._grammars is not None:
            self._grammars.close()
