"""Edge worker settings (env prefix ``MESHSERVE_EDGE_WORKER_``, YAML section ``edge_worker:``)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from services.common.config import default_load_cache_dir
from services.common.errors import ConfigError
from services.common.model_paths import model_paths
from services.worker.config import WorkerSettings


class EdgeWorkerSettings(WorkerSettings):
    """Settings of one edge worker replica."""

    service: ClassVar[str] = "edge_worker"
    model_config = SettingsConfigDict(env_prefix="MESHSERVE_EDGE_WORKER_", extra="ignore")

    model_dir: Path | None = None
    """onnxruntime-genai model directory (genai_config.json, model.onnx, tokenizer.json); empty uses
    `<models_dir>/<model_id>/edge-int4` from `meshserve models prepare`."""

    engine: Literal["batched", "og"] = "batched"
    """`batched`: one onnxruntime decode call for all live sequences (KV slots, continuous batching;
    docs/edge.md). `og`: one onnxruntime-genai generator per sequence (the sequences take turns)."""
    batch_invariant: bool = True
    """Batched engine: decode a lone sequence in a two-row call (a dummy row), so its tokens equal what
    it gets in any batch (the INT4 kernels round one row differently from several). Off: a lone
    sequence runs one row (~20 % less CPU per token) and greedy output can depend on the load."""
    lm_head: Literal["nbits", "int8"] = "int8"
    """Batched engine: `int8` rewrites the LM head at load time onto onnxruntime's int8 GEMM (MLAS
    QGEMM, 16 outlier input channels in fp32): ~11 % less CPU per 16-row decode call, ~8 % per 2-row
    call, same perplexity, ~1.5 s more to load (docs/edge.md). `nbits` runs the head as built
    (8-bit MatMulNBits)."""
    int4_kernel: Literal["auto", "mlas", "native"] = "auto"
    """Batched engine: `native` runs the 4-bit matmuls on our own row-invariant AVX2 kernel, an
    onnxruntime custom op compiled with gcc at the first start (`services/edge_worker/native`; needs gcc
    and an x86-64 CPU with AVX2, FMA and F16C, else the worker does not start): every decode row is then the
    same whatever else is in the call, so a lone sequence decodes in one row and stays batch invariant,
    and the calls are faster (docs/edge.md, issue 27). `mlas` runs them on onnxruntime's MatMulNBits.
    `auto` (the default): native where it can be built and run, else mlas with a warning in the log
    saying why; mlas with `adaptive_threading` (the op's thread count is fixed in the edited graph, so
    `native` cannot be combined with it)."""
    intra_op_spinning: bool = True
    """Batched engine: idle intra-op threads spin before they block, for at most `intra_op_spin_us`.
    A decode step has ~150 parallel sections; threads that block at once are woken for each and
    arrive late, so the calling thread runs most of the work alone (a lone stream ~25 % slower on 2
    cores). false: they block at once (less CPU on a machine shared with other busy work;
    docs/edge.md)."""
    intra_op_spin_us: int = Field(default=200, ge=0, le=100_000)
    """Batched engine with `intra_op_spinning`: how long an idle intra-op thread spins before it blocks
    (onnxruntime's `session.intra_op.spin_duration_us`): long enough to span the gaps between one
    decode step's parallel sections, not the time between steps. 0: onnxruntime's own default, which
    spins much longer."""
    adaptive_threading: bool = False
    """Batched engine with more than one thread (`intra_op_spinning` is then ignored): two more sessions of the
    model, one whose threads spin inside a decode call (and sleep between calls), one of a single
    thread; each decode call of up to `adaptive_max_rows` sequences runs on whichever of the three
    measures fastest now (meant for: spinning on an idle host, one thread on a loaded one). Same
    tokens either way; the prepacked weights are held three times (RSS ~+280 MiB). Off by default:
    on the loaded build machine it was not reliably faster, and the idle-host case is unmeasured
    (docs/edge.md, issue 27)."""
    adaptive_max_rows: int = Field(default=4, ge=1, le=64)
    """Batched engine: decode calls of more sequences than this always run on the main session."""
    load_cache: bool = True
    """Batched engine: keep the edited decoder graph (the int8 LM head and its calibration, ~1.6 s of CPU
    per start) in ``load_cache_dir`` and use it on later starts; a stale or corrupt entry is never used
    (docs/edge.md, *Startup*)."""
    load_cache_dir: Path | None = None
    """Where ``load_cache`` keeps it; empty uses the user's cache,
    `~/.cache/meshserve/load-cache/edge` (whatever the models directory is)."""
    background_max_hold_s: float = Field(default=2.0, gt=0.0, le=10.0)
    """Batched engine: background sequences (batch lines) sit out every step while a foreground turn
    runs on this worker or on another worker of its host; after this long held without a break, one
    step lets them through, so a line is delayed, never starved (docs/edge.md, *Background sequences
    yield*). At most 10 s: well under the router's stall timeout (30 s), which a held line must never
    reach between two of its tokens."""
    prefill_chunk_tokens: int = Field(default=512, ge=16, le=8192)
    """Batched engine: prompt tokens per prefill call (bounds the logits buffer: 192 KB per token)."""
    chat_reserve_tokens: int = Field(default=512, ge=0)
    """og engine: KV room a chat sequence keeps beyond its first turn so later turns extend it in place
    (the builder's CPU model preallocates KV up to a generator's max_length: ~46 KB per token for
    SmolLM2-135M). A later turn that does not fit starts a fresh sequence. The batched engine grows
    KV slots on demand instead."""

    @model_validator(mode="after")
    def _check_int4_kernel(self) -> EdgeWorkerSettings:
        if self.int4_kernel == "native" and self.adaptive_threading:
            raise ConfigError(
                "MESHSERVE_EDGE_WORKER_INT4_KERNEL=native cannot be combined with ADAPTIVE_THREADING=true "
                "(the native op's threads are fixed in the graph); turn one of them off"
            )
        return self

    def resolved_load_cache_dir(self) -> Path | None:
        if not self.load_cache:
            return None
        return self.load_cache_dir or default_load_cache_dir("edge")

    def resolved_model_dir(self) -> Path:
        return self.model_dir or model_paths(self.model_id).edge_dir

    def check_model(self) -> Path:
        """The model directory, or ConfigError saying how to get one (checked when the worker starts)."""
        path = self.resolved_model_dir()
        if not (path / "genai_config.json").is_file():
            raise ConfigError(
                f"no onnxruntime-genai model at {path}; run `meshserve models prepare` "
                "or set MESHSERVE_EDGE_WORKER_MODEL_DIR to a directory with genai_config.json"
            )
        return path
