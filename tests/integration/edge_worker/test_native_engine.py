"""The batched edge engine with ``int4_kernel=native`` on the real INT4 model: a lone sequence decodes in one
row and its greedy tokens still equal what it gets in any batch; every MatMulNBits but the head (4- and 8-bit) is
on the op and all the model's attention nodes go to our attention op; the native graph's logits, prefill and a
one-row decode step, stay close to the MLAS graph's and pick the same top token (the numbers are printed:
``pytest -s``).

Skipped, with the reason, where the kernel cannot be built or run (no gcc, not x86-64 with AVX2, FMA and F16C)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from services.common.model_paths import model_paths
from services.edge_worker.graph import load_session
from services.edge_worker.graph_edit import edited_model
from services.edge_worker.kvslots import KvSlots
from services.edge_worker.native.attention_graph import OP as ATTENTION_OP
from services.edge_worker.native.attention_graph import use_attention_op
from services.edge_worker.native.graph import DOMAIN, OP
from services.edge_worker.native.kernel import unavailable_reason
from services.edge_worker.ort_engine import OrtEngine
from tests.integration.edge_worker.test_ort_engine import PROMPTS, chat, generate, together

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or ""),
]


@pytest.fixture(scope="module")
def engine() -> Iterator[OrtEngine]:
    # two threads: the op's helper thread shares the columns; small KV capacity and chunks as in test_ort_engine
    engine = OrtEngine(
        model_paths().edge_dir,
        model_id="t",
        threads=2,
        max_batch=4,
        kv_capacity=16,
        prefill_chunk=16,
        int4_kernel="native",
    )
    yield engine
    engine.close()


def test_a_lone_sequence_decodes_in_one_row_with_the_tokens_it_gets_in_any_batch(
    engine: OrtEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert engine.min_rows == 1 and "rows>=1" in engine.info.build and "int4=native" in engine.info.build
    prompts = [chat(engine, p) for p in PROMPTS]
    call_rows: list[int] = []
    binding = engine._kv.binding

    def spy(session: ort.InferenceSession, first: int, rows: int) -> Any:
        call_rows.append(rows)
        return binding(session, first, rows)

    monkeypatch.setattr(engine._kv, "binding", spy)
    steps_before = engine.steps
    alone = [generate(engine, p, 12) for p in prompts]
    decode_rows = call_rows[-(engine.steps - steps_before) :]
    assert decode_rows and set(decode_rows) == {1}  # every decode call of a lone sequence: one row
    rows_before, steps_before = engine.rows, engine.steps
    both = together(engine, [(p, 12) for p in [*prompts, *prompts[:2]]])
    assert both == [*alone, *alone[:2]]
    assert engine.rows - rows_before > engine.steps - steps_before  # some decode calls had several rows


def test_threads_that_spin_a_bounded_time_give_the_same_tokens(engine: OrtEngine) -> None:
    """The worker's default (``INTRA_OP_SPINNING=true``, ``INTRA_OP_SPIN_US=200``) against the fixture's
    sleeping threads: the same kernels, so the same greedy tokens alone and batched."""
    spinning = OrtEngine(
        model_paths().edge_dir, model_id="t", threads=2, max_batch=4, int4_kernel="native", spinning=True, spin_us=200
    )
    try:
        prompts = [chat(engine, p) for p in PROMPTS]
        plain = [generate(engine, p, 10) for p in prompts]
        alone = [generate(spinning, p, 10) for p in prompts]
        both = together(spinning, [(p, 10) for p in [*prompts, *prompts[:2]]])
    finally:
        spinning.close()
    assert alone == plain and both == [*plain, *plain[:2]]


def _logits(session: ort.InferenceSession, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The last position's logits after a prefill of ``ids``, and after a prefill of ``ids[:-1]`` then a
    one-row decode step of ``ids[-1]`` on its KV; past and present KV bound to one buffer as the engine
    binds them (the native graph's attention op requires it)."""
    decoder = json.loads((model_paths().edge_dir / "genai_config.json").read_text())["model"]["decoder"]

    def run(kv: KvSlots, tokens: list[int], length: int) -> np.ndarray:
        io = kv.binding(session, 0, 1)
        io.bind_cpu_input("input_ids", np.array([tokens], dtype=np.int64))
        io.bind_cpu_input("attention_mask", np.ones((1, length), dtype=np.int64))
        io.bind_output("logits")
        session.run_with_iobinding(io)
        return np.asarray(io.get_outputs()[0].numpy())[0, -1]

    def slots() -> KvSlots:
        return KvSlots(
            layers=int(decoder["num_hidden_layers"]), kv_heads=int(decoder["num_key_value_heads"]),
            head_size=int(decoder["head_size"]), slots=1, capacity=len(ids), max_capacity=len(ids),
        )  # fmt: skip

    whole = run(slots(), ids, len(ids))
    kv = slots()
    run(kv, ids[:-1], len(ids) - 1)
    step = run(kv, ids[-1:], len(ids))
    return whole, step


def test_every_matmulnbits_but_the_head_runs_on_the_op() -> None:
    path = model_paths().edge_dir / "model.onnx"
    options = ort.SessionOptions()
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
    options.intra_op_num_threads = 1
    graph = edited_model(path, options, lm_head="int8", int4_kernel="native")
    ours = [node for node in graph.graph.node if (node.domain, node.op_type) == (DOMAIN, OP)]
    kinds = [({a.name: a.i for a in node.attribute}["bits"], {a.name: a.i for a in node.attribute}.get("act", 0))
             for node in ours]  # fmt: skip
    fused, plain4, plain8 = kinds.count((4, 1)), kinds.count((4, 0)), kinds.count((8, 0))
    left = [node.name for node in graph.graph.node if node.op_type in ("MatMulNBits", "Sigmoid")]
    print(f"on the op: {plain4} 4-bit, {plain8} 8-bit matmuls and {fused} MLPs' gate+up+SwiGLU; left: {left}")
    # 122 4-bit matmuls: 30 MLPs' gate and up (60) fused in pairs, 62 others; the 28 8-bit ones
    assert (fused, plain4, plain8) == (30, 62, 28) and len(ours) == 120 and not left
    head = next(node for node in graph.graph.node if "logits" in node.output)
    assert head.op_type != OP  # the int8 head (MatMulIntegerToFloat) stays as it is


def test_native_logits_are_close_to_mlas(engine: OrtEngine) -> None:
    path = model_paths().edge_dir / "model.onnx"
    sessions = {}
    for kernel in ("mlas", "native"):
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        sessions[kernel] = load_session(path, options, lm_head="int8", int4_kernel=kernel)
    diffs, agree, step_diffs, step_agree = [], 0, [], 0
    for text in PROMPTS:
        ids = chat(engine, text)
        (mlas, mlas_step), (native, native_step) = (_logits(sessions[k], ids) for k in ("mlas", "native"))
        diffs.append(round(float(np.abs(mlas - native).max()), 3))
        agree += int(np.argmax(mlas) == np.argmax(native))
        step_diffs.append(round(float(np.abs(mlas_step - native_step).max()), 3))
        step_agree += int(np.argmax(mlas_step) == np.argmax(native_step))
    print(f"native vs mlas, last-position logits of {len(PROMPTS)} prompts: max |diff| {diffs}, top-1 agree {agree}")
    print(f"  the same after a one-row decode step: max |diff| {step_diffs}, top-1 agree {step_agree}")
    assert agree >= len(PROMPTS) - 1 and step_agree >= len(PROMPTS) - 1
    assert max(diffs) < 2.0 and max(step_diffs) < 2.0


def test_every_attention_node_of_the_model_is_replaced() -> None:
    model = onnx.load(str(model_paths().edge_dir / "model.onnx"), load_external_data=False)
    layers = sum(node.op_type == "GroupQueryAttention" for node in model.graph.node)
    assert layers > 0 and use_attention_op(model) == layers
    assert not any(node.op_type == "GroupQueryAttention" for node in model.graph.node)
    assert sum(node.op_type == ATTENTION_OP and node.domain == DOMAIN for node in model.graph.node) == layers
