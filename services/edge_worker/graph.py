"""Load the model builder's decoder with its LM head applied to the last two positions only.

The builder's graph computes logits for every input position, so a prefill chunk of 512 tokens ran
the 49152 x 576 LM head 512 times (about a fifth of the chunk's compute) and returned 96 MiB of
logits, which were copied into Python (holding the GIL) to read one row. The engine only ever reads
the last position. Two positions, not one: MatMulNBits computes one row (M=1) differently from
several (its int8-activation kernels), and rows of an M>=2 call do not depend on each other, so the
last row is the same as in the full graph (and a decode row, length 1, is unchanged).

The edit is a ``Slice`` in front of the LM head, made in memory at load time: the prepared model on
disk (and onnxruntime-genai's use of it) is unchanged; the weights are read from the model directory.
The edit itself is :mod:`services.edge_worker.graph_edit` (the one user of ``onnx`` on a worker), run only
when the load cache has no entry: the edited graph is kept in a cache directory for the next start
(:mod:`services.edge_worker.load_cache`).
``lm_head="int8"`` also moves the head onto onnxruntime's int8 GEMM (:mod:`services.edge_worker.int8head`).
``int4_kernel="native"`` moves the 4-bit matmuls onto our row-invariant kernel, an onnxruntime custom op
(:mod:`services.edge_worker.native.graph`), and the attention onto our own op
(:mod:`services.edge_worker.native.attention_graph`).
"""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import numpy as np
import onnxruntime as ort
import structlog

from services.edge_worker.load_cache import DATA_ALIGN, INLINE_LIMIT, GraphCache, graph_key
from services.edge_worker.native import kernel as native_kernel
from services.models.biascorrect import CALIBRATION_TEXT

log = structlog.get_logger(__name__)

_HERE = Path(__file__).parent
EDIT_SOURCES = (_HERE / "graph_edit.py", _HERE / "int8head.py")
"""The modules that make the edit: a change to either makes a new cache entry."""
NATIVE_SOURCES = (
    _HERE / "native" / "graph.py",
    _HERE / "native" / "attention_graph.py",
    _HERE / "native" / "swiglu_graph.py",
)
"""The modules that put the native ops into the graph (their C sources: ``native_kernel.SOURCES``)."""


LM_HEADS = ("nbits", "int8")
INT4_KERNELS = ("mlas", "native")


def native_library() -> Path:
    """The compiled kernel + custom op library (built once per source version); ValueError with the reason
    in one sentence when this machine cannot build or run it (no gcc, no AVX2/FMA/F16C)."""
    try:
        return native_kernel.compile_kernel()
    except native_kernel.KernelUnavailable as exc:
        raise ValueError(f"int4_kernel 'native' cannot be used here: {exc}") from None


def load_session(
    model_path: Path,
    options: ort.SessionOptions,
    *,
    lm_head: str = "nbits",
    cache_dir: Path | None = None,
    int4_kernel: str = "mlas",
) -> ort.InferenceSession:
    """An onnxruntime session of ``model_path`` whose ``logits`` are ``[batch, min(2, seq), vocab]``.

    ``lm_head``: ``nbits`` runs the head as built; ``int8`` on MLAS' int8 GEMM with its outlier
    channels in fp32, found on the calibration text (needs the builder's 8-bit MatMulNBits head,
    ``models prepare --int4-lm-head int8``, the default). ``cache_dir``: keep the edited graph there
    and use it on later loads (:mod:`services.edge_worker.load_cache`); None edits it every time.
    ``int4_kernel``: ``mlas`` runs the 4-bit matmuls on onnxruntime's MatMulNBits; ``native`` on our
    row-invariant kernel (:mod:`services.edge_worker.native`; needs gcc and AVX2).
    """
    return load_sessions(model_path, [options], lm_head=lm_head, cache_dir=cache_dir, int4_kernel=int4_kernel)[0]


def load_sessions(
    model_path: Path,
    options: list[ort.SessionOptions],
    *,
    lm_head: str = "nbits",
    cache_dir: Path | None = None,
    int4_kernel: str = "mlas",
    last_positions: bool = True,
) -> list[ort.InferenceSession]:
    """One session per ``options`` over the same edited graph (edited or read from the cache once, with
    ``options[0]``'s threads for the calibration run and the native kernel's threads; ``load_session``).
    ``last_positions=False`` keeps the logits of every position (teacher-forced quality measurements;
    never cached)."""
    if lm_head not in LM_HEADS:
        raise ValueError(f"lm_head {lm_head!r} is not one of {LM_HEADS}")
    if int4_kernel not in INT4_KERNELS:
        raise ValueError(f"int4_kernel {int4_kernel!r} is not one of {INT4_KERNELS}")
    if int4_kernel == "native":
        library = native_library()
        for each in options:
            each.register_custom_ops_library(str(library))
    graph: bytes | None = None
    folder = model_path.parent
    """Where the graph's external data is: the model directory, or the cache entry's data file."""
    if cache_dir is not None and last_positions:
        cache, key = GraphCache(cache_dir), _cache_key(model_path, lm_head, options[0], int4_kernel)
        graph = cache.get(key)
        log.info("edge_graph_cache", hit=graph is not None, entry=str(cache_dir / f"{key}.onnx"))
        stored = graph is not None
        if graph is None:
            graph, stored = _edit_and_store(cache, key, model_path, options[0], lm_head, int4_kernel)
        if stored:
            folder = cache_dir
    if graph is None:
        from services.edge_worker.graph_edit import edited_model  # onnx: only on a cache miss (graph_edit.py)

        graph = edited_model(
            model_path,
            _edit_options(options[0], folder),
            lm_head=lm_head,
            int4_kernel=int4_kernel,
            last_positions=last_positions,
        ).SerializeToString()
    for each in options:
        each.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    return [ort.InferenceSession(graph, each, providers=["CPUExecutionProvider"]) for each in options]


def _edit_and_store(
    cache: GraphCache, key: str, model_path: Path, options: ort.SessionOptions, lm_head: str, int4_kernel: str
) -> tuple[bytes, bool]:
    """Edit the graph and write it to the cache as an entry; the graph to load and whether it is the
    entry's (its weights in the cache's data file) or, when the write failed, whole (weights inline and
    in the model directory)."""
    from services.edge_worker.graph_edit import edited_model, external_weights  # onnx: only on a miss

    model = edited_model(
        model_path, _edit_options(options, model_path.parent), lm_head=lm_head, int4_kernel=int4_kernel
    )
    entry, weights = external_weights(
        model, model_path.parent, cache.data_name(key), align=DATA_ALIGN, inline_limit=INLINE_LIMIT
    )
    if cache.put(key, entry, weights, model_path.parent):
        return entry, True
    return model.SerializeToString(), False


def _edit_options(options: ort.SessionOptions, folder: Path) -> ort.SessionOptions:
    """The graph edit's own options (its calibration run): ``options``' threads, the model directory's
    external data (the sessions' options name the folder of the graph they load, set once)."""
    edit = ort.SessionOptions()
    edit.intra_op_num_threads = options.intra_op_num_threads
    edit.inter_op_num_threads = options.inter_op_num_threads
    edit.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    return edit


def _cache_key(model_path: Path, lm_head: str, options: ort.SessionOptions, int4_kernel: str = "mlas") -> str:
    settings: dict[str, object] = {
        "lm_head": lm_head,
        # the calibration run's threads: a different split of its sums could rank a near-tie differently
        "intra_op_threads": options.intra_op_num_threads,
    }
    versions = {"onnx": version("onnx"), "onnxruntime": ort.__version__, "numpy": np.__version__}
    # the edit's constants are in its sources; load_cache.py holds the entry's format
    sources = [Path(__file__), *EDIT_SOURCES, _HERE / "load_cache.py", CALIBRATION_TEXT]
    if int4_kernel != "mlas":  # only then: the default's key (and its cached entries) stay as they were
        settings["int4_kernel"] = int4_kernel
        settings["int4_kernel_threads"] = native_kernel.kernel_threads(options.intra_op_num_threads)
        # the C sources too: they define the packed layout the edited graph's weights are in
        sources += [*NATIVE_SOURCES, Path(native_kernel.__file__), *native_kernel.SOURCES, *native_kernel.HEADERS]
    return graph_key(model_path, settings=settings, sources=sources, versions=versions)
