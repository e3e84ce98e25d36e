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

**Closing before the budget runs out** (``open(..., max_tokens=)``): vLLM and OpenAI return JSON cut at
``length`` when ``max_tokens`` runs out mid-value. Here, in a turn's last tokens, the mask keeps only
the tokens after which the answer can still end validly within the budget (close the open strings,
arrays and objects, write the properties its schema still requires, then EOS): a choice among a few
tokens has each tried, a string's plain content stays allowed, and when the tokens left are exactly the
ending and its EOS, only the ending's tokens are. The answer ends valid with ``finish_reason: stop``
(:attr:`TokenConstraint.budget_closed` says the budget restricted it; it reaches the caller's usage
details). llguidance has no query for the shortest way to close a value,
so :class:`_Closer` (our own code) finds a short one by walking the matcher: at each point it takes the
grammar's forced tokens (``compute_ff_tokens``), else the first of a fixed list of closing candidates
the matcher accepts (``validate_tokens``: ``"``, ``}``, ``]``, ``0``, ``null``, ... chosen by whether
the text is inside a JSON string), else the lowest token the mask allows, until the matcher accepts;
then it rolls the matcher back (``rollback``). Each try costs ~1 us in llguidance; a walk of 10 tokens
~0.1 ms, done only in a turn's last steps. It is shortest for JSON (what it is for); for a regex or a
grammar it is a valid ending, not always the shortest. Every decision is a function of the tokens so far
(replayed ones included) and the budget, so a resumed stream masks exactly as the undisturbed one.
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
CLOSE_MARGIN = 4
"""The steps before the last moment (the tokens left = the ending + EOS) in which the model may only take
tokens that keep the ending within what is left after them: one free token can lengthen the ending by a
few (``{"`` opens an object and a key), which would then no longer fit. At the last moment only the
ending's next token is allowed."""
CLOSE_LOOKAHEAD = 16
"""The ending is measured at every step once the tokens left are within this many of those steps by the
last periodic measurement (taken every :data:`CLOSE_RECHECK` tokens)."""
CLOSE_TRY = 64
"""In a turn's last :data:`CLOSE_LIMIT` tokens, a mask of at most this many tokens has each token tried
(its ending measured after it) and keeps those whose ending still fits: a comma in an array of tool
calls commits to a whole next call (~24 tokens), far more than :data:`CLOSE_MARGIN` covers. A larger
mask (a string's content, a free value) keeps, near the end, the string's plain content (no quote,
backslash or control byte: it leaves the ending as it is) and the ending's next token."""
CLOSE_RECHECK = 4
"""The ending is measured after every this-many tokens, generated or replayed, so when closing begins is a
function of the tokens alone: a resumed stream closes where the undisturbed one did."""
CLOSE_TRIES = 16
"""Most tokens tried in one step (each costs a walk of its ending, ~0.1-0.5 ms); a choice with more of them
is handled as a large one."""
CLOSE_SLACK = 8
"""A token that opens, closes and separates nothing (digits, letters, a string's opening quote and text)
is kept without a try while the tokens left exceed the ending by this much: its ending grows by a few at
most (a quote opening a required key: its name, ``": "`` and a value)."""
CLOSE_GROWTH = 32
"""Most tokens one token may add to the ending that the small-mask check guards against (a comma opening
another tool call adds ~24): with more room than the ending and this, no token is tried. An array of
larger items may still end at ``length`` when its comma comes too late."""
CLOSE_LIMIT = 96
"""Longest ending searched for; a constraint that needs more is left to end at ``length``."""
_IN_STRING = ('"}]', '"]}', '"}}', '"}', '"]', '"')
"""Closing candidates inside a JSON string (as text; tokenized once per vocabulary), most closing first."""
_ESCAPED = ("n", '"', "\\", "t")
_OUTSIDE = ("}]", "]}", "}}", "]]", "}", "]", ",", "0", "null", "true", "false", '""', "[]", "{}", '"', ":", " ")
"""Outside a string: closers, then the comma a required property still needs (never valid where a value
must come), then the shortest values, then what opens a key."""
_FILLERS = ("0", "a", " ", "x")
"""What a string that may not end yet (``minLength``, a pattern, a unicode escape) gets before its quote."""


class _JsonLexer:
    """Whether the text so far ends inside a JSON string (and after its backslash): what orders the
    closing candidates. Bytes outside JSON (a grammar's text around it) are read the same way; only the
    candidates' order depends on it, never what is valid."""

    __slots__ = ("escape", "in_string")

    def __init__(self, in_string: bool = False, escape: bool = False) -> None:
        self.in_string = in_string
        self.escape = escape

    def feed(self, data: bytes) -> None:
        for byte in data:
            if self.escape:
                self.escape = False
            elif self.in_string and byte == 0x5C:  # backslash
                self.escape = True
            elif byte == 0x22:  # quote
                self.in_string = not self.in_string

    def copy(self) -> _JsonLexer:
        return _JsonLexer(self.in_string, self.escape)


class _Closer:
    """Finds a short valid ending of a constrained text for one vocabulary (see the module docstring)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, eos_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._eos = frozenset(eos_ids)

        def ids(texts: Sequence[str]) -> list[list[int]]:
            return [tokenizer.tokenize_str(t) for t in texts]

        self._in_string = ids(_IN_STRING)
        self._escaped = ids(_ESCAPED)
        self._outside = ids(_OUTSIDE)
        self._fillers = ids(_FILLERS)
        self._bytes: dict[int, bytes] = {}
        self._content: np.ndarray | None = None
        self._structural: np.ndarray | None = None

    def content_words(self, words: int) -> np.ndarray:
        """A bitmask (``words`` int32 words) of the tokens that are plain JSON string content: valid UTF-8
        with no quote, backslash or control byte (built once, ~50 ms)."""
        if self._content is None:
            plain = np.zeros(words * 32, dtype=bool)
            for token in range(min(self._tokenizer.vocab_size, words * 32)):
                if self._tokenizer.is_special_token(token):
                    continue
                data = self._tokenizer.decode_bytes([token])
                if not data or b'"' in data or b"\\" in data or min(data) < 0x20:
                    continue
                try:
                    data.decode("utf-8")
                except UnicodeDecodeError:
                    continue
                plain[token] = True
            self._content = np.packbits(plain, bitorder="little").view(np.int32)
        return self._content

    def structural(self, token: int) -> bool:
        """The token holds a byte that opens or separates JSON (``{[,:`` or a backslash): after it the ending
        may be much longer (a comma opening another array element); after any other token (digits,
        letters, quotes, closers, plain text) it grows by a few tokens at most."""
        if self._structural is None:
            marks = frozenset(b"{[,:\\")
            self._structural = np.array(
                [any(b in marks for b in self._tokenizer.decode_bytes([t])) for t in range(self._tokenizer.vocab_size)]
            )
        return bool(self._structural[token]) if token < self._structural.size else True

    def token_bytes(self, token: int) -> bytes:
        found = self._bytes.get(token)
        if found is None:
            found = self._bytes[token] = self._tokenizer.decode_bytes([token])
        return found

    def ending(self, matcher: llguidance.LLMatcher, lexer: _JsonLexer, limit: int) -> list[int] | None:
        """The tokens that take ``matcher`` to an accepting state ([] when it is in one), at most ``limit``
        of them (None: none found within it). The matcher is left as it was."""
        lexer = lexer.copy()
        plan: list[int] = []
        try:
            while not matcher.is_accepting():
                if len(plan) >= limit or matcher.is_error() or matcher.is_stopped():
                    return None
                step = matcher.compute_ff_tokens() or self._candidate(matcher, lexer)
                if not step:
                    return None
                step = step[: limit - len(plan)] or step[:1]
                if not matcher.consume_tokens(step):
                    return None
                plan.extend(step)
                for token in step:
                    lexer.feed(self.token_bytes(token))
            return plan
        finally:
            if plan:
                matcher.rollback(len(plan))

    def _candidate(self, matcher: llguidance.LLMatcher, lexer: _JsonLexer) -> list[int]:
        lists: tuple[list[list[int]], ...]
        if lexer.escape:
            lists = (self._escaped, self._fillers)
        elif lexer.in_string:
            lists = (self._in_string, self._fillers)
        else:
            lists = (self._outside,)
        for candidates in lists:
            for tokens in candidates:
                if tokens and matcher.validate_tokens(tokens) == len(tokens):
                    return tokens
        words = np.frombuffer(matcher.compute_bitmask(), dtype="<u4")
        for word in np.flatnonzero(words):  # the lowest allowed token that is not EOS
            bits = int(words[word])
            while bits:
                low = bits & -bits
                token = int(word) * 32 + low.bit_length() - 1
                if token not in self._eos:
                    return [token]
                bits ^= low
        return []


class TokenConstraint:
    """One sequence's grammar state: which tokens may come next, advanced by each token generated.

    Not thread-safe: the thread that samples the sequence (the edge batch thread, the cloud scheduler
    thread) owns it.
    """

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        vocab_size: int,
        eos_ids: Iterable[int],
        closer: _Closer | None = None,
        max_tokens: int | None = None,
    ) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.eos_ids = np.array(sorted(eos_ids), dtype=np.int64)
        self._bitmask = llnp.allocate_token_bitmask(1, vocab_size)
        eos_only = np.zeros(self._bitmask.shape[1] * 32, dtype=bool)
        eos_only[self.eos_ids] = True
        self._fallback = np.packbits(eos_only, bitorder="little").view(np.int32)
        self._closer = closer if max_tokens is not None else None
        self._max_tokens = max_tokens
        self._consumed = 0  # tokens advanced over (replayed ones included)
        self._lexer = _JsonLexer()
        self._closed = False
        self._decided_at = -1  # ``_consumed`` when ``_mask`` was last computed
        self._mask = self._fallback
        self._ending_len = 0  # the length of the ending at the last periodic measurement
        self._one = np.zeros_like(self._bitmask[0])
        if self._closer is not None:
            self._ending_len = self._measure()

    @property
    def budget_closed(self) -> bool:
        """The mask began closing the answer because the budget (``max_tokens``) was about to run out
        (first only the tokens that keep a valid ending within it, at the last moment only the ending's):
        the answer ends valid, with EOS, not at ``length``."""
        return self._closed

    def bitmask(self) -> np.ndarray:
        """The allowed next tokens, one bit per token id (int32 words, bit i of word j = token 32j+i).

        EOS is allowed only where the text is complete. A matcher in an error state (a replayed token
        the grammar rejects) allows EOS only, so the sequence ends instead of producing garbage. Near the
        end of the budget, only the tokens that keep a valid ending within it (the module docstring).
        """
        if self._matcher.is_error():
            return self._fallback
        if self._decided_at == self._consumed:  # asked again in the same step: the same answer
            return self._mask
        self._decided_at = self._consumed
        llnp.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        self._mask = self._bitmask[0]
        budgeted = self._budget_mask(self._mask)
        if budgeted is not None:
            if not self._closed:
                self._closed = not np.array_equal(budgeted, self._mask)
            self._mask = budgeted
        return self._mask

    def _one_hot(self, token: int) -> np.ndarray:
        self._one.fill(0)
        self._one.view(np.uint32)[token >> 5] = np.uint32(1 << (token & 31))
        return self._one

    def _budget_mask(self, grammar: np.ndarray) -> np.ndarray | None:
        """The mask the budget imposes on the grammar's ``grammar`` now (None: it applies unchanged).

        In a turn's last :data:`CLOSE_LIMIT` tokens: a choice among a few tokens (a comma that would open
        another array element, a key, ...) keeps only those after which a valid ending still fits;
        among many (a string's content, a free value), once the tokens left come within
        :data:`CLOSE_MARGIN` of the ending, the string's plain content and the ending's next token; when
        they are just the ending and its EOS, the ending alone."""
        if self._closer is None or self._max_tokens is None:
            return None
        left = self._max_tokens - self._consumed  # tokens this turn may still produce, this one included
        if left <= 0 or left > CLOSE_LIMIT + 1:
            return None
        count = int(np.bitwise_count(grammar.view(np.uint32)).sum())
        if count <= 1:
            return None  # nothing to choose
        if count <= CLOSE_TRY:
            fitting = self._fitting(grammar, left)
            if fitting is None or isinstance(fitting, np.ndarray):
                return fitting
        return self._near_end(grammar, left)

    def _near_end(self, grammar: np.ndarray, left: int) -> np.ndarray | None:
        """Many tokens to choose from: free until the tokens left come within :data:`CLOSE_MARGIN` of the
        ending; then a string's plain content and the ending's next token; at the last moment that token."""
        assert self._closer is not None
        if self._ending_len >= CLOSE_LIMIT or left > self._ending_len + 1 + CLOSE_MARGIN + CLOSE_LOOKAHEAD:
            return None  # far from it (or no ending found) by the last periodic measurement
        ending = self._closer.ending(self._matcher, self._lexer, CLOSE_LIMIT)
        if not ending:
            return None  # no ending found (the answer ends at length), or complete with free text to follow
        need = len(ending) + 1  # and its EOS
        if need > left or need + CLOSE_MARGIN < left:
            return None  # too late (the answer ends at length), or still free to write
        if need == left:  # the last moment: the ending alone (the next step's is this one's rest)
            return self._one_hot(ending[0])
        kept = np.zeros_like(grammar)
        if self._lexer.in_string and not self._lexer.escape:  # plain content keeps the ending as it is
            kept = grammar & self._closer.content_words(grammar.size)
        kept.view(np.uint32)[ending[0] >> 5] |= np.uint32(1 << (ending[0] & 31))
        return kept

    def _fitting(self, grammar: np.ndarray, left: int) -> np.ndarray | bool | None:
        """The tokens of ``grammar`` (a few) after which a valid ending still fits in ``left - 1`` tokens:
        those that open, close or separate JSON tried on the matcher, the others kept while there is room
        (None: all of them, or none: the grammar's mask stands; False: too many to try, see
        :meth:`_near_end`)."""
        assert self._closer is not None
        current = self._closer.ending(self._matcher, self._lexer, CLOSE_LIMIT)
        if current is None:
            return None  # no ending found from here: the answer ends at length whatever comes next
        if left - 2 >= len(current) + CLOSE_GROWTH:
            return None  # room for any token's ending to come
        tokens = [int(t) for t in np.flatnonzero(unpack(grammar, self.vocab_size))]
        roomy = len(current) + CLOSE_SLACK <= left
        tried = [t for t in tokens if t not in self.eos_ids and (self._closer.structural(t) or not roomy)]
        if len(tried) > CLOSE_TRIES:
            return False
        kept = np.zeros_like(grammar)
        for token in tokens:
            fits = token not in tried
            if not fits and self._matcher.consume_token(token):
                lexer = self._lexer.copy()
                lexer.feed(self._closer.token_bytes(token))
                ending = self._closer.ending(self._matcher, lexer, max(left - 2, 0))
                self._matcher.rollback(1)
                fits = ending is not None and len(ending) + 1 <= left - 1
            if fits:
                kept.view(np.uint32)[token >> 5] |= np.uint32(1 << (token & 31))
        if not kept.any() or np.array_equal(kept, grammar):
            return None
        return kept

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
        token = int(token)
        self._consumed += 1
        if self._closer is not None:
            self._lexer.feed(self._closer.token_bytes(token))
        if not self._matcher.is_error() and not self._matcher.is_stopped():
            if not self._matcher.consume_token(token):
                log.warning("grammar_token_rejected", token=token, error=self._matcher.get_error()[:200])
        if self._closer is not None and self._consumed % CLOSE_RECHECK == 0:
            self._ending_len = self._measure()

    def _measure(self) -> int:
        """The length of the ending from here (:data:`CLOSE_LIMIT` when none is found within it)."""
        assert self._closer is not None
        if self._matcher.is_error():
            return CLOSE_LIMIT
        ending = self._closer.ending(self._matcher, self._lexer, CLOSE_LIMIT)
        return CLOSE_LIMIT if ending is None else len(ending)

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
        self._closer: _Closer | None = None
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

    def open(
        self, constraint: Constraint, replay: Sequence[int] = (), *, max_tokens: int | None = None
    ) -> TokenConstraint:
        """A fresh per-sequence state for ``constraint``, advanced over ``replay`` (a resumed stream's
        tokens, already generated). ``max_tokens``: the turn's budget in tokens, replayed ones included;
        the mask then closes the answer validly before it runs out (the module docstring); None: no
        budget closing. Blocking; raises InvalidArgument for a constraint that does not compile (or not
        in time)."""
        closer = self._closing() if max_tokens is not None else None
        matcher = self.compiled(constraint).deep_copy()
        state = TokenConstraint(matcher, self.vocab_size, self.eos_ids, closer, max_tokens)
        for token in replay:
            state.advance(token)
        return state

    def _closing(self) -> _Closer:
        tokenizer = self._tokenizer()
        with self._lock:
            if self._closer is None:
                self._closer = _Closer(tokenizer, self.eos_ids)
            return self._closer

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
