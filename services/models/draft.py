"""The speculative-decoding draft ``draft-int8/``: an ONNX INT8 build of ``hf/`` (step 4 of `models prepare`).

The cloud worker's default draft (services/gpu_worker/config.py). INT8 agrees with the fp32 target
on 95 % of tokens against 78 % for the edge tier's INT4 model, which took speculative decoding from
1.27x to 1.80x (docs/cloud.md). Built by the same builder subprocess as the edge model
(:func:`services.models.prepare.run_builder`), atomically, and skipped when complete and newer than
``hf/``; not part of the manifest (derived from ``hf/``, whose digests the version already covers).
"""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from services.common.model_paths import ModelPaths
from services.models import prepare as prep

# The measured build (docs/cloud.md): asymmetric 8-bit blocks of 32, int8 activations, untied embeddings.
DRAFT_OPTIONS = ["block_size=32", "is_symmetric=false", "accuracy_level=4", "shared_embeddings=false"]


def draft_complete(paths: ModelPaths) -> bool:
    """True when ``draft-int8/`` is a complete onnxruntime-genai model built from the current ``hf/``."""
    config = paths.draft_dir / "genai_config.json"
    if not prep.edge_complete(paths.draft_dir):
        return False
    hf_config = paths.hf_dir / "config.json"
    return not hf_config.is_file() or config.stat().st_mtime >= hf_config.stat().st_mtime


def build_draft(hf_dir: Path, dest: Path, log_path: Path, show_progress: bool = True) -> None:
    """ONNX INT8 (CPU) model for onnxruntime-genai from ``hf_dir``."""
    prep.run_builder(hf_dir, dest, log_path, "int8", DRAFT_OPTIONS, "draft model", show_progress)


def prepare_draft(paths: ModelPaths, *, force: bool = False, show_progress: bool = True) -> bool:
    """Build ``draft-int8/`` unless it is complete and current (or ``force``); True when it was built."""
    with prep.locked(paths.root):
        if not force and draft_complete(paths):
            return False
        if not prep.hf_complete(paths.hf_dir):
            raise prep.PrepareError(f"no HF checkpoint at {paths.hf_dir} to build the draft from")
        if paths.draft_dir.exists() and not force:
            tqdm.write(f"draft model at {paths.draft_dir} is incomplete or older than hf/; rebuilding it")
        log_path = paths.root / "draft-build.log"
        prep.build_atomically(paths.draft_dir, lambda tmp: build_draft(paths.hf_dir, tmp, log_path, show_progress))
    return True
