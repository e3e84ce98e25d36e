"""Structured output in the workers: a constraint compiled into a per-sequence token mask (llguidance).

Why llguidance (docs/structured_output.md has the numbers and the commands): it compiles a JSON
schema lazily (1-12 ms for realistic to 200-property schemas on SmolLM2's 49,152-token vocabulary,
where outlines-core 0.2 builds its whole token index up front: 1.6 s for a realistic order schema,
11.7 s for 200 properties), computes a step's mask in ~25-65 us, and bounds its own work
(``LLParserLimits``). Our own code is only the glue: compile bounded in time, a bounded LRU of compiled
grammars, and the mask applied to a logits row.

:class:`GrammarCompiler` belongs to one engine (its tokenizer, vocabulary and EOS ids). Its
:meth:`~GrammarCompiler.open` blocks (call it from a worker thread, never the event loop): the
compilation itself runs on the compiler's own small pool and is abandoned after
:data:`~services.common.constraints.COMPILE_TIMEOUT_S` with InvalidArgument. Each sequence gets a
:class:`TokenConstraint`: the matcher state, advanced by every accepted (or replayed) token.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import llguidance
import llguidance.numpy as llnp
import numpy as np
import structlog
from tokenizers import Tokenizer

from services.common.constraints import COMPILE_TIMEOUT_S, FIELD, Constraint, grammar_text, short_error
from services.common.errors import InvalidArgument

log = structlog.get_logger(__name__)

GRAMMAR_CACHE_ENTRIES = 64
"""Compiled grammars kept per engine (LRU, by the constraint's digest)."""


class TokenConstraint:
    """One sequence's grammar state: which tokens may come next, advanced by each token generated.

    Not thread-safe: the thread that samples the sequence (the edge batch thread, the cloud scheduler
    thread) owns it.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_ids: Iterable[int]) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.eos_ids = np.array(sorted(eos_ids), dtype=np.int64)
        self._bitmask = llnp.allocate_token_bitmask(1, vocab_size)
        eos_only = np.zeros(self._bitmask.shape[1] * 32, dtype=bool)
        eos_only[self.eos_ids] = True
        self._fallback = np.packbits(eos_only, bitorder="little").view(np.int32)

    def bitmask(self) -> np.ndarray:
        """The allowed next tokens, one bit per token id (int32 words, bit i of word j = token 32j+i).

        EOS is allowed only where the text is complete. A matcher in an error state (a replayed token
        the grammar rejects) allows EOS only, so the sequence ends instead of producing garbage.
        """
        if self._matcher.is_error():
            return self._fallback
        llnp.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        return self._bitmask[0]

    def allowed(self) -> np.ndarray:
        """The allowed next tokens as a ``[vocab_size]`` bool row."""
        return unpack(self.bitmask(), self.vocab_size)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` (a writable ``[vocab]`` float row, changed in place) with every disallowed token at
        -inf (~65 us a row on SmolLM2's vocabulary: the mask ~25, the rest numpy)."""
        words = np.invert(self.bitmask()).view(np.uint8)
        disallowed = np.unpackbits(words, bitorder="little")[: self.vocab_size].view(bool)
        np.copyto(logits[: self.vocab_size], -np.inf, where=disallowed)
        logits[self.vocab_size :] = -np.inf
        return logits

    def first_allowed(self) -> int:
        """The lowest allowed token id: the choice when every allowed token's logit is -inf (EOS, the
        grammar's only way on, banned by ``min_tokens``: the grammar wins)."""
        return int(np.flatnonzero(self.allowed())[0])

    def advance(self, token: int) -> None:
        """``token`` was generated or replayed. A rejected one puts the matcher in its error state
        (logged; the sequence may then only end)."""
        if not self._matcher.is_error() and not self._matcher.is_stopped():
            if not self._matcher.consume_token(int(token)):
                log.warning("grammar_token_rejected", token=int(token), error=self._matcher.get_error()[:200])

    @property
    def accepting(self) -> bool:
        """The text so far is a complete sentence of the language."""
        return bool(self._matcher.is_accepting())


def unpack(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """An int32 bitmask row as a ``[vocab_size]`` bool row."""
    return np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab_size].astype(bool)


class GrammarCompiler:
    """Compiles constraints for one engine's tokenizer (bounded in time; an LRU of compiled grammars)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_ids: Iterable[int],
        *,
        timeout_s: float = COMPILE_TIMEOUT_S,
        cache_entries: int = GRAMMAR_CACHE_ENTRIES,
    ) -> None:
        self._hf_tokenizer = tokenizer  # serialized for llguidance on first use: ~0.1-0.6 s a start need not pay
        self.vocab_size = vocab_size
        self.eos_ids = tuple(sorted(eos_ids))
        self.timeout_s = timeout_s
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._cache_entries = cache_entries
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        # Two threads: a compilation abandoned at its timeout still runs to the end of llguidance's own
        # limits; the second keeps the next request from queueing behind it.
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")

    def _tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary (~0.5-0.9 s once, outside any compile timeout)."""
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._hf_tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=list(self.eos_ids)
                )
            return self._ll_tokenizer

    def warm(self) -> None:
        """Build the llguidance tokenizer now (a worker may call it at start)."""
        self._tokenizer()

    def compiled(self, constraint: Constraint) -> llguidance.LLMatcher:
        """A matcher in its start state for ``constraint`` (shared: deep-copy it before use). Blocking."""
        with self._lock:
            hit = self._cache.get(constraint.digest)
            if hit is not None:
                self._cache.move_to_end(constraint.digest)
                return hit
        tokenizer = self._tokenizer()
        future = self._pool.submit(_compile, tokenizer, constraint)
        try:
            matcher = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            log.warning("grammar_compile_timeout", kind=constraint.kind, timeout_s=self.timeout_s)
            raise InvalidArgument(
                f"{FIELD}: the {constraint.kind} did not compile within the limit of {self.timeout_s:g} s; "
                "simplify it (fewer alternatives, smaller counted repetitions)"
            ) from None
        with self._lock:
            self._cache[constraint.digest] = matcher
            while len(self._cache) > self._cache_entries:
                self._cache.popitem(last=False)
        return matcher

    def open(self, constraint: Constraint, replay: Sequence[int] = ()) -> TokenConstraint:
        """A fresh per-sequence state for ``constraint``, advanced over ``replay`` (a resumed stream's
        tokens, already generated). Blocking; raises InvalidArgument for a constraint that does not
        compile (or not in time)."""
        state = TokenConstraint(self.compiled(constraint).deep_copy(), self.vocab_size, self.eos_ids)
        for token in replay:
            state.advance(token)
        return state

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _compile(tokenizer: llguidance.LLTokenizer, constraint: Constraint) -> llguidance.LLMatcher:
    """Compile on a pool thread (llguidance drops the GIL while it builds the grammar)."""
    matcher = llguidance.LLMatcher(tokenizer, grammar_text(constraint), log_level=0)
    if matcher.is_error():
        raise InvalidArgument(
            f"{FIELD}: the {constraint.kind} is not valid or not supported ({short_error(matcher.get_error())}); fix it"
        )
    return matcher
