"""A served model's generation defaults: what a request gets for the sampling fields it leaves unset.

The defaults belong to the model, as vLLM takes them from a checkpoint's ``generation_config.json``
(its ``ModelConfig.get_diff_sampling_param``: ``temperature``, ``top_p``, ``top_k``,
``repetition_penalty`` and ``max_new_tokens`` as ``max_tokens``, overridable by the operator). Ours
come in layers, each overriding the one before it field by field (:meth:`GenerationDefaults.over`):
the checkpoint's ``generation_config.json`` (:func:`read_generation_config`), the router's models file
(the model, then its version), then the operator's settings (``MESHSERVE_ROUTER_GENERATION_DEFAULTS``).
A field no layer sets keeps the mesh's neutral value (:class:`~services.common.sampling.SamplingParams`'
field defaults: greedy, no top-p/top-k, no penalty; ``max_tokens`` the router's ``default_max_tokens``).

A request's explicit field always wins: :func:`~services.common.sampling.resolve_sampling` records
which fields a request left unset (``SamplingParams.defaulted``), and :meth:`GenerationDefaults.apply`
fills only those. The router applies them, once, where it knows the model and its version
(``RouterAPI.turn_request``), before anything reads the sampling (cache key, collapsing, workers).

A default penalty never acts on constrained tokens: under structured output (``sampling.structured``:
``response_format``, a regex or grammar, or a tool call's constraint) the model's
``repetition_penalty`` is not applied (it counts the prompt, so the model would avoid exactly the words
a JSON value or a tool argument must copy from it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from services.common.errors import InvalidArgument
from services.common.sampling import MESH_LIMITS, SamplingParams, resolve_sampling

GENERATION_CONFIG = "generation_config.json"
"""The file of a Hugging Face checkpoint directory that holds the model creator's generation defaults."""
_FROM_CHECKPOINT = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
    "stop_strings": "stop",
}
"""generation_config.json key -> our field (vLLM's set, and transformers' ``stop_strings``)."""


@dataclass(frozen=True)
class GenerationDefaults:
    """Defaults of the sampling fields a request may leave unset; None: no default here (a lower layer's,
    or the mesh's neutral value). Build checked ones with :meth:`from_mapping`."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    """Not applied under structured output (see the module docstring)."""
    max_tokens: int | None = None
    """Fills a request's ``max_tokens`` 0 (clamped to the room the prompt leaves, as the router's own default)."""
    stop: tuple[str, ...] | None = None

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str) -> GenerationDefaults:
        """Checked defaults from a mapping of our field names (a models-file entry, the settings); the
        ranges are the requests' own (:func:`~services.common.sampling.resolve_sampling`); ``where`` names
        the source in the error (ValueError: these are configuration, not requests)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{where}: unknown generation default {unknown[0]!r}; use {', '.join(sorted(known))}")
        got = {k: v for k, v in values.items() if v is not None}
        for name in ("temperature", "top_p", "repetition_penalty"):
            value = got.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
                raise ValueError(f"{where}: {name} must be a number (got {value!r})")
        for name in ("top_k", "max_tokens"):
            value = got.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{where}: {name} must be an integer (got {value!r})")
        stop = got.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and (not isinstance(stop, list | tuple) or not all(isinstance(s, str) for s in stop)):
            raise ValueError(f"{where}: stop must be a string or a list of strings (got {stop!r})")
        if got.get("max_tokens") is not None and got["max_tokens"] < 1:
            raise ValueError(f"{where}: max_tokens must be at least 1 (got {got['max_tokens']})")
        defaults = cls(
            temperature=None if "temperature" not in got else float(got["temperature"]),
            top_p=None if "top_p" not in got else float(got["top_p"]),
            top_k=got.get("top_k"),
            repetition_penalty=None if "repetition_penalty" not in got else float(got["repetition_penalty"]),
            max_tokens=got.get("max_tokens"),
            stop=None if stop is None else tuple(stop),
        )
        try:  # the requests' own checks, so a default is never one a request could not ask for
            resolve_sampling(
                temperature=defaults.temperature,
                top_p=defaults.top_p,
                top_k=defaults.top_k,
                repetition_penalty=defaults.repetition_penalty,
                stop=defaults.stop or (),
                limits=MESH_LIMITS,
            )
        except InvalidArgument as exc:
            raise ValueError(f"{where}: {exc.message.replace('sampling.', '')}") from None
        if defaults.top_p is not None and defaults.top_p == 0.0:
            defaults = replace(defaults, top_p=1.0)  # 0 means off, as in a request
        return defaults

    def over(self, base: GenerationDefaults) -> GenerationDefaults:
        """These defaults over ``base``: each field of ours that is set wins."""
        return GenerationDefaults(
            **{
                f.name: getattr(base, f.name) if getattr(self, f.name) is None else getattr(self, f.name)
                for f in fields(self)
            }
        )

    def apply(self, sampling: SamplingParams) -> SamplingParams:
        """``sampling`` with the fields its request left unset (``sampling.defaulted``) filled from these
        defaults, the repetition penalty only for an unconstrained turn; ``max_tokens`` stays 0 for
        :meth:`SamplingParams.fit`, which takes :attr:`max_tokens` as its default. The result has no
        defaulted field left: nothing downstream applies a default again."""
        if not sampling.defaulted:
            return sampling
        changes: dict[str, Any] = {}
        for name in sampling.defaulted:
            value = getattr(self, name, None)
            if value is None or name == "max_tokens":
                continue
            if name == "repetition_penalty" and sampling.structured is not None:
                continue  # penalties never act on constrained tokens (module docstring)
            changes[name] = value
        return replace(sampling, defaulted=frozenset(), **changes)

    def as_dict(self) -> dict[str, Any]:
        """The fields that are set (ListModels, ``GET /v1/models``, logs)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


NO_DEFAULTS = GenerationDefaults()


def read_generation_config(checkpoint_dir: Path | None) -> GenerationDefaults:
    """The defaults in ``checkpoint_dir``'s ``generation_config.json`` (none: no such file).

    As vLLM: only the sampling keys are read (``temperature``, ``top_p``, ``top_k``,
    ``repetition_penalty``, ``max_new_tokens`` as ``max_tokens``; and transformers' ``stop_strings``);
    token ids, ``do_sample`` and the rest are not ours to apply. A file that does not parse, or a value
    out of range, is a ValueError naming the file (a start-up error: a checkpoint is configuration).
    """
    if checkpoint_dir is None:
        return NO_DEFAULTS
    path = Path(checkpoint_dir) / GENERATION_CONFIG
    try:
        text = path.read_text()
    except FileNotFoundError:
        return NO_DEFAULTS
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc}; fix its permissions or remove it") from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); fix or remove it") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path} must hold a JSON object")
    values = {ours: doc[theirs] for theirs, ours in _FROM_CHECKPOINT.items() if doc.get(theirs) is not None}
    top_k = values.get("top_k")
    if isinstance(top_k, int) and top_k < 0:  # transformers' and vLLM's "off"
        values["top_k"] = 0
    return GenerationDefaults.from_mapping(values, str(path))
