"""API scopes: what a credential may do at the gateway.

=============== ==========================================================
scope           grants
=============== ==========================================================
``inference``   Generate, Complete, Chat, Embed, ListModels, Files and Batches (the default)
``models:read`` ListModels only (dashboards, health checkers)
``*``           everything, including scopes added later
=============== ==========================================================

Where scopes come from: a stored key's ``scopes`` (``meshserve keys create --scopes``), a JWT's
``scope`` claim (space-separated, OAuth 2.0 style, or a list). A credential that names no scopes —
a key created without ``--scopes``, a JWT without a ``scope`` claim — gets ``inference``. Static keys
(``MESHSERVE_GATEWAY_API_KEYS``) are the operator's own and get ``*``.
A credential without the scope a method needs is refused with PERMISSION_DENIED (HTTP 403).

Models: a credential may be limited to a list of model ids: a stored key's (``meshserve keys create
--models a,b``), a static key's (``tenant:sha256hex:a|b``), a JWT's (its ``models`` claim); a request
naming another model, or naming none (the mesh's default is not known here), is refused
with PERMISSION_DENIED, and ListModels shows only the key's models.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.common.errors import PermissionDenied

INFERENCE = "inference"
MODELS_READ = "models:read"
ALL = "*"
KNOWN = (INFERENCE, MODELS_READ, ALL)
DEFAULT = (INFERENCE,)

_GRANTS: dict[str, frozenset[str]] = {
    "Generate": frozenset({INFERENCE, ALL}),
    "Complete": frozenset({INFERENCE, ALL}),
    "Chat": frozenset({INFERENCE, ALL}),
    "Embed": frozenset({INFERENCE, ALL}),
    "ListModels": frozenset({INFERENCE, MODELS_READ, ALL}),
    "Batches": frozenset({INFERENCE, ALL}),  # every Files and Batches call
}


def effective(scopes: Iterable[str]) -> tuple[str, ...]:
    """The scopes a credential holds: its own, or :data:`DEFAULT` when it names none."""
    held = tuple(s for s in scopes if s)
    return held or DEFAULT


def check_known(scopes: Iterable[str]) -> tuple[str, ...]:
    """``scopes`` if every one is known; raises ValueError naming the bad one (for key creation)."""
    out = tuple(s.strip() for s in scopes if s.strip())
    for scope in out:
        if scope not in KNOWN:
            raise ValueError(f"unknown scope {scope!r}; use {', '.join(KNOWN)}")
    return out


def grants(method: str, scopes: Iterable[str]) -> bool:
    """Whether ``scopes`` grant ``method``."""
    return not _GRANTS[method].isdisjoint(scopes)


def require(method: str, scopes: Iterable[str], key_id: str) -> None:
    """Raise :class:`PermissionDenied` unless ``scopes`` grant ``method``."""
    granted_by = _GRANTS[method]
    if granted_by.isdisjoint(scopes):
        needed = INFERENCE if method != "ListModels" else f"{INFERENCE} or {MODELS_READ}"
        raise PermissionDenied(
            f"credential {key_id} may not call {method}: it needs the {needed} scope; use a key that has it"
        )


def require_model(model: str, models: tuple[str, ...], key_id: str) -> None:
    """Raise :class:`PermissionDenied` unless ``models`` (a credential's list; empty: any) holds ``model``."""
    if models and model not in models:
        named = f"model {model!r}" if model else "the default model (the request names none)"
        raise PermissionDenied(
            f"credential {key_id} may not use {named}; it may use {', '.join(models)}: name one in the model field"
        )
