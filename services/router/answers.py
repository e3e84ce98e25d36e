"""The names of a request's answer: its response-cache entry and its collapse key.

The tiers run different weights under one model id (edge: the INT4 student, cloud: the fp32
teacher), so one deterministic request has one answer *per tier*: every name here includes the
tier whose weights produce the answer. The router decides that tier before the cache lookup
(``Router.answer_tier``) and stores a finished answer under the tier that actually served it
(``turn.store_response``). Keys themselves come from ``services.store.keys``.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.router.policy import TierName
from services.router.turn import Session, TurnRequest
from services.store.keys import response_key
from services.store.response_cache import ResponseCache


@dataclass(frozen=True)
class AnswerKeys:
    """Key builders of one router (its model, version and tokenizer)."""

    model_id: str
    model_version: str
    tokenizer_id: str
    cache: ResponseCache
    collapse: bool = True
    """Whether identical deterministic requests in flight may share one computation."""

    def key(self, req: TurnRequest, tier: TierName) -> str:
        """The response-cache key of ``req`` as ``tier``'s weights answer it."""
        return response_key(
            model_id=self.model_id,
            model_version=self.model_version,
            tier=tier.value,
            tokenizer_id=self.tokenizer_id,
            sampling=req.sampling,
            prompt_ids=req.prompt_ids,
            tenant=req.tenant,
            shareable=req.shareable,
        )

    def cache_key(self, req: TurnRequest, tier: TierName) -> str | None:
        """:meth:`key`, or None when ``req`` must not use the cache (bypass, sampled, cache off)."""
        if not (req.use_cache and self.cache.enabled and req.sampling.deterministic):
            return None
        return self.key(req, tier)

    def collapse_key(self, req: TurnRequest, session: Session, tier: TierName) -> str | None:
        """Identical deterministic requests that may share the caches, bound for the same tier with the
        same hint, may share one computation (chat turns never do)."""
        if not (self.collapse and req.use_cache and req.sampling.deterministic) or session.chat:
            return None
        hint = req.hint.value if req.hint else "auto"
        return f"{self.key(req, tier)}:{hint}"
