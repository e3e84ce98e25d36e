"""Tenant policy: the limits one tenant's requests are held to, from defaults plus overrides.

Resolution, later wins: the gateway's defaults, then the tenant's entry in ``tenant_policies``,
then the limits stored on the API key that authenticated the call (``meshserve keys create --rpm``).
A value of 0 for a rate (rpm, tpm) or for ``max_concurrent_streams`` means "unlimited".

Prompt tokens are estimated from the text (the gateway does not tokenize; the router does, once):
``ceil(utf8_bytes / 3) + 4`` per message. Byte-level BPE tokenizers average ~4 bytes per token on
English, so the estimate is high on purpose; the token reservation is settled with the real usage
when the request ends, so a high estimate only delays admission, it never costs the tenant tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from services.common.errors import InvalidArgument

POLICY_FIELDS = (
    "requests_per_minute",
    "request_burst",
    "tokens_per_minute",
    "max_concurrent_streams",
    "max_prompt_tokens",
    "max_tokens",
    "priority",
    "batch_lines_in_flight",
    "batch_file_bytes",
)
_BYTES_PER_TOKEN = 3
_MESSAGE_OVERHEAD = 4


@dataclass(frozen=True)
class TenantPolicy:
    """Limits of one tenant. 0 for a rate or for ``max_concurrent_streams`` means unlimited."""

    requests_per_minute: int = 600
    request_burst: int = 0
    """Requests admitted at once from an idle bucket; 0 = ``requests_per_minute``."""
    tokens_per_minute: int = 200_000
    max_concurrent_streams: int = 16
    max_prompt_tokens: int = 8192
    max_tokens: int = 4096
    priority: int = 5
    """Highest routing priority (0-9) this tenant may ask for; higher asks are lowered to it."""
    batch_lines_in_flight: int = 50_000
    """Most lines of this tenant's unfinished batches at once (0 = unlimited); a bigger batch is refused."""
    batch_file_bytes: int = 256 * 1024 * 1024
    """Most bytes of files this tenant stores (uploads and batch outputs; 0 = unlimited)."""

    @property
    def burst(self) -> int:
        return self.request_burst or self.requests_per_minute

    def with_overrides(self, overrides: Mapping[str, int] | None) -> TenantPolicy:
        """This policy with the given fields replaced (unknown names raise ValueError)."""
        if not overrides:
            return self
        unknown = set(overrides) - set(POLICY_FIELDS)
        if unknown:
            raise ValueError(f"unknown policy fields {sorted(unknown)}; use {', '.join(POLICY_FIELDS)}")
        for name, value in overrides.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"policy field {name} must be a whole number >= 0 (got {value!r})")
        return replace(self, **{k: int(v) for k, v in overrides.items()})


class PolicyBook:
    """Defaults plus per-tenant overrides; :meth:`for_tenant` resolves one tenant's policy."""

    def __init__(self, default: TenantPolicy, tenants: Mapping[str, Mapping[str, int]] | None = None) -> None:
        self.default = default
        self._tenants = {name: default.with_overrides(over) for name, over in (tenants or {}).items()}

    def for_tenant(self, tenant: str, key_overrides: Mapping[str, int] | None = None) -> TenantPolicy:
        base = self._tenants.get(tenant, self.default)
        return base.with_overrides(key_overrides)


def estimate_prompt_tokens(texts: Iterable[str]) -> int:
    """A high estimate of the prompt tokens of these messages (see the module docstring)."""
    total = 0
    for text in texts:
        size = len(text.encode("utf-8", "surrogatepass"))
        total += -(-size // _BYTES_PER_TOKEN) + _MESSAGE_OVERHEAD
    return total


def check_request(policy: TenantPolicy, prompt_tokens: int, max_tokens: int) -> None:
    """Raise :class:`InvalidArgument` when a request can never fit this tenant's policy."""
    if policy.max_prompt_tokens and prompt_tokens > policy.max_prompt_tokens:
        raise InvalidArgument(
            f"prompt is about {prompt_tokens} tokens, above your limit of {policy.max_prompt_tokens}; shorten it"
        )
    if policy.max_tokens and max_tokens > policy.max_tokens:
        raise InvalidArgument(
            f"sampling.max_tokens is {max_tokens}, above your limit of {policy.max_tokens}; ask for fewer"
        )
    need = prompt_tokens + max_tokens
    if policy.tokens_per_minute and need > policy.tokens_per_minute:
        raise InvalidArgument(
            f"this request may use {need} tokens (prompt + max_tokens), more than your {policy.tokens_per_minute} "
            "tokens per minute; lower max_tokens or shorten the prompt"
        )


def check_embed_inputs(policy: TenantPolicy, inputs: Iterable[str | int]) -> None:
    """Raise :class:`InvalidArgument` when one input of an Embed request (a text, or a count of token
    ids) is above the tenant's ``max_prompt_tokens`` (each input is one prompt; the total is bounded by
    the tokens per minute)."""
    if not policy.max_prompt_tokens:
        return
    for i, item in enumerate(inputs):
        tokens = estimate_prompt_tokens([item]) if isinstance(item, str) else item
        if tokens > policy.max_prompt_tokens:
            raise InvalidArgument(
                f"inputs[{i}] is about {tokens} tokens, above your limit of {policy.max_prompt_tokens}; shorten it"
            )


def allowed_priority(policy: TenantPolicy, asked: int) -> int:
    """The routing priority a request runs with: what it asked, capped at its tenant's class."""
    return min(asked, policy.priority)


__all__ = [
    "POLICY_FIELDS",
    "PolicyBook",
    "TenantPolicy",
    "allowed_priority",
    "check_request",
    "estimate_prompt_tokens",
]
