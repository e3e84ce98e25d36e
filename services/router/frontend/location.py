"""Where a prompt's KV prefix is: how many of its leading blocks each replica of a tier holds, and Redis.

Answers ``RouterAdmin.PrefixLocation`` (``meshserve cache where``) from what routing itself uses, so
the answer is what the router acts on:

* it is about one version of one served model (services/router/frontend/models.py; the admin service picks it:
  the one asked for, else the default model's primary version, :meth:`PrefixLocator.scoped`): that
  version's Router, its replicas only, its tokenizer and context;
* the prompt is tokenized as the router's Inference service tokenizes it: a text with the tokenizer
  (Generate), a conversation through the chat template (Chat, whose turns carry the whole
  conversation so far);
* the tier is the one asked for, else the router's own choice for this prompt now
  (:meth:`Router.choose`: tenant tiers, prompt length, health, saturation);
* a replica's count is :meth:`CacheAware.cached_blocks` over :meth:`Router.blocks`, the number
  the policy scores the replica with: the hot blocks of its latest load report plus what the router
  sent it since;
* Redis is asked once (:meth:`KVBlockStore.leading_blocks` on the router's response-cache
  connection, at most ``max_blocks`` blocks) under the model id, version and block size the cloud
  workers report, since they are the ones that export KV there (the router's own when none has
  reported). Redis down, slow or not configured: the count is unknown, never an error.

Nothing here is on the request path: routing never asks Redis (a round trip per request, for what
the workers' load reports already tell).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import partial

from services.common.errors import InvalidArgument, Unavailable
from services.common.sampling import SamplingParams
from services.router.balancer.core import Router, Session
from services.router.balancer.tiers import TierChoice, TierName
from services.router.frontend.encoding import tokenize
from services.router.types import TurnRequest
from services.store.kv_blocks import LOCATE_MAX_BLOCKS, KVBlockStore, KVContext

MAX_PROMPT_CHARS = 1 << 20
"""Longest prompt (text, or all message contents) accepted, in characters: checked before tokenizing."""


class RedisAnswer(StrEnum):
    """Whether the Redis count is known."""

    ANSWERED = "answered"
    UNAVAILABLE = "unavailable"
    """Redis did not answer in time (down, slow, breaker open)."""
    DISABLED = "disabled"
    """The router has no Redis configured."""


@dataclass(frozen=True)
class Holder:
    """One healthy replica of the tier and the leading prompt blocks routing counts it as holding."""

    address: str
    worker_id: str
    cached_blocks: int


@dataclass(frozen=True)
class PrefixLocation:
    """The answer: the prompt's size in blocks, the tier and its replicas' counts, Redis's count."""

    prompt_tokens: int
    block_tokens: int
    tier: TierChoice
    holders: list[Holder]
    redis: RedisAnswer
    redis_blocks: int
    """Leading blocks in Redis; 0 unless ``redis`` is ANSWERED."""
    redis_checked_blocks: int
    redis_block_tokens: int
    model_id: str
    model_version: str
    """Model id and version the Redis keys were built with."""

    @property
    def prompt_blocks(self) -> int:
        return self.prompt_tokens // self.block_tokens


class PrefixLocator:
    """Answers prefix-location questions about one router (see the module docstring)."""

    def __init__(
        self,
        router: Router,
        *,
        block_tokens: int,
        context_length: int,
        redis_timeout_s: float = 0.5,
        max_blocks: int = LOCATE_MAX_BLOCKS,
    ) -> None:
        self._router = router
        self._block = block_tokens
        """The router's prefix block size (``Router.blocks`` hashes with it)."""
        self._context = context_length
        self._redis_timeout = redis_timeout_s
        """Timeout of the Redis question: longer than the response cache's, this is no request's path."""
        self._max_blocks = max_blocks

    def scoped(self, router: Router, context_length: int) -> PrefixLocator:
        """The same locator over another router: one version of a served model (services/router/frontend/models.py)."""
        return PrefixLocator(
            router,
            block_tokens=self._block,
            context_length=context_length,
            redis_timeout_s=self._redis_timeout,
            max_blocks=self._max_blocks,
        )

    async def tokenize(self, text: str, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Prompt token ids of ``text`` or of the conversation ``messages`` (exactly one must be given)."""
        if text and messages:
            raise InvalidArgument("give the prompt as text or as chat messages, not both")
        if not text and not messages:
            raise InvalidArgument("the prompt is empty; give the text or the chat messages to look up")
        size = len(text) or sum(len(m.get("content", "")) for m in messages)
        if size > MAX_PROMPT_CHARS:
            raise InvalidArgument(f"the prompt is {size} characters long; at most {MAX_PROMPT_CHARS} are accepted")
        tok = self._router.tokenizer
        if text:
            return await tokenize(partial(tok.encode, text), size)
        return await tokenize(partial(tok.apply_chat_template, [dict(m) for m in messages]), size)

    async def locate(
        self,
        *,
        text: str = "",
        messages: Sequence[Mapping[str, str]] = (),
        tenant: str = "",
        shareable: bool = False,
        tier: TierName | None = None,
    ) -> PrefixLocation:
        """Where the leading blocks of the prompt are: raises InvalidArgument for a bad prompt only."""
        ids = await self.tokenize(text, messages)
        if not ids:
            raise InvalidArgument("the prompt is empty; give at least one character of text")
        if len(ids) > self._context:
            raise InvalidArgument(
                f"the prompt is {len(ids)} tokens long, more than the model's context of {self._context} tokens"
            )
        router = self._router
        spec = SamplingParams(max_tokens=0)
        req = TurnRequest(ids, spec, hint=tier, use_cache=False, shareable=shareable, tenant=tenant, request_id="")
        choice = TierChoice(tier, "requested") if tier is not None else self._choose(req)
        blocks = router.blocks(req)
        holders = [
            Holder(r.address, r.worker_id, router.selector.cached_blocks(r.address, blocks, r.hot_blocks))
            for r in router.healthy(choice.tier)
        ]
        model_id, version, redis_block = self._redis_scope()
        checked = min(len(ids) // redis_block, self._max_blocks)
        found: int | None = None
        answer = RedisAnswer.DISABLED
        if router.cache.enabled:
            store = KVBlockStore(router.cache.guard, block_tokens=redis_block, timeout_s=self._redis_timeout)
            found = await store.leading_blocks(KVContext(model_id, version, tenant, shareable), ids, checked)
            answer = RedisAnswer.UNAVAILABLE if found is None else RedisAnswer.ANSWERED
        return PrefixLocation(
            prompt_tokens=len(ids),
            block_tokens=self._block,
            tier=choice,
            holders=holders,
            redis=answer,
            redis_blocks=found or 0,
            redis_checked_blocks=checked,
            redis_block_tokens=redis_block,
            model_id=model_id,
            model_version=version,
        )

    def _choose(self, req: TurnRequest) -> TierChoice:
        """The router's tier for ``req`` now; with no usable worker, the tier the prompt prefers."""
        try:
            return self._router.choose(req, ())
        except Unavailable:
            return TierChoice(self._router.answer_tier(req, Session()), "no_healthy_worker")

    def _redis_scope(self) -> tuple[str, str, int]:
        """(model id, model version, block tokens) of the KV the cloud workers export: from the first
        cloud replica of the router's version that reported them (healthy ones first), else the router's own."""
        router = self._router
        serves = router.serves
        cloud = [r for r in router.registry.replicas if r.tier is TierName.CLOUD and (serves is None or serves(r))]
        for r in sorted(cloud, key=lambda r: not r.healthy):
            if r.report.model_version and r.report.block_tokens > 0:
                return r.report.model_id or router.model_id, r.report.model_version, r.report.block_tokens
        return router.model_id, router.model_version, self._block
