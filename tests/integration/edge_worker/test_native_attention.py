"""The onnxruntime custom op ``meshserve.edge:Attention`` (``attn.c``, int4_kernel=native) against onnxruntime's own
GroupQueryAttention on random data, past and present bound to one buffer as the engine binds them: decode (one
row and 16, several past lengths including 0) and prefill chunks (past 0 and > 0) give outputs and KV within fp32
rounding (the largest differences are printed: ``pytest -s``); each row is bit for bit the same alone or with
others and at any thread count; unsupported inputs fail with a message, unsupported nodes are left alone.

Skipped, with the reason, where the library cannot be built or run (no gcc, not x86-64 with AVX2, FMA and F16C)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from services.edge_worker.native.attention_graph import OP, use_attention_op
from services.edge_worker.native.graph import DOMAIN
from services.edge_worker.native.kernel import compile_kernel, unavailable_reason

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or ""),
]

H, KVH, D, CAP, POSITIONS = 9, 3, 64, 256, 2048
WIDTH = (H + 2 * KVH) * D
ATOL = 2e-5


def _caches() -> tuple[np.ndarray, np.ndarray]:
    pos = np.arange(POSITIONS)[:, None] / (10000 ** (np.arange(D // 2) / (D // 2)))
    return np.cos(pos).astype(np.float32), np.sin(pos).astype(np.float32)


def _gqa_model(**attrs: float | int) -> onnx.ModelProto:
    settings: dict[str, float | int] = {
        "num_heads": H, "kv_num_heads": KVH, "scale": 0.125, "do_rotary": 1, "rotary_interleaved": 0,
        "local_window_size": -1, "softcap": 0.0,
    }  # fmt: skip
    settings.update(attrs)
    node = helper.make_node(
        "GroupQueryAttention", ["qkv", "", "", "pk", "pv", "sk", "tl", "cos", "sin"], ["o", "prk", "prv"],
        domain="com.microsoft", name="gqa", **settings,
    )  # fmt: skip
    cos, sin = _caches()
    kv = ["batch", KVH, "capacity", D]
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("qkv", TensorProto.FLOAT, ["batch", "seq", WIDTH]),
            helper.make_tensor_value_info("pk", TensorProto.FLOAT, kv),
            helper.make_tensor_value_info("pv", TensorProto.FLOAT, kv),
            helper.make_tensor_value_info("sk", TensorProto.INT32, ["batch"]),
            helper.make_tensor_value_info("tl", TensorProto.INT32, []),
        ],
        [
            helper.make_tensor_value_info("o", TensorProto.FLOAT, ["batch", "seq", H * D]),
            helper.make_tensor_value_info("prk", TensorProto.FLOAT, kv),
            helper.make_tensor_value_info("prv", TensorProto.FLOAT, kv),
        ],
        [numpy_helper.from_array(cos, "cos"), numpy_helper.from_array(sin, "sin")],
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)], ir_version=10
    )


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_kernel(tmp_path_factory.mktemp("attn-op"))


def _session(model: onnx.ModelProto, library: Path | None, threads: int = 1) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if library is not None:
        options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _ours(library: Path, threads: int = 1, **attrs: float | int) -> ort.InferenceSession:
    model = _gqa_model(**attrs)
    assert use_attention_op(model) == 1
    assert [(n.domain, n.op_type) for n in model.graph.node] == [(DOMAIN, OP)]
    return _session(model, library, threads)


def _run(
    session: ort.InferenceSession, qkv: np.ndarray, key: np.ndarray, value: np.ndarray, lengths: list[int], total: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One call with past and present bound to copies of ``key``/``value``; ``lengths``: total length per row."""
    key, value = key.copy(), value.copy()
    io = session.io_binding()
    io.bind_cpu_input("qkv", qkv)
    io.bind_output("o")  # first: get_outputs() lists the outputs in binding order
    for name, present, array in (("pk", "prk", key), ("pv", "prv", value)):
        shared = ort.OrtValue.ortvalue_from_numpy(array)
        io.bind_ortvalue_input(name, shared)
        io.bind_ortvalue_output(present, shared)
    io.bind_cpu_input("sk", np.array(lengths, np.int32) - 1)
    io.bind_cpu_input("tl", np.array(total, np.int32))
    session.run_with_iobinding(io)
    out = io.get_outputs()[0].numpy()
    assert out.shape == (qkv.shape[0], qkv.shape[1], H * D)
    return out, key, value


def _data(batch: int, seq: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((batch, seq, WIDTH), dtype=np.float32)
    key = rng.standard_normal((batch, KVH, CAP, D), dtype=np.float32)
    value = rng.standard_normal((batch, KVH, CAP, D), dtype=np.float32)
    return qkv, key, value


CASES = [
    # (batch, query positions, past length per row): decode, then prefill chunks (first prompt, later chunk)
    (1, 1, [0]),
    (1, 1, [1]),
    (1, 1, [7]),
    (1, 1, [100]),
    (1, 1, [CAP - 1]),
    (16, 1, [0, 3, 8, 9, 15, 16, 17, 31, 63, 64, 99, 100, 128, 200, 254, 255]),
    (16, 1, [100] * 16),
    (1, 37, [0]),
    (3, 20, [0, 0, 0]),
    (1, 33, [50]),
    (1, 16, [16]),
    (1, 100, [156]),
]


@pytest.mark.parametrize(("batch", "seq", "past"), CASES)
def test_the_op_matches_onnxruntimes_group_query_attention(
    library: Path, batch: int, seq: int, past: list[int]
) -> None:
    qkv, key, value = _data(batch, seq, seed=batch * 1000 + seq + sum(past))
    lengths = [p + seq for p in past]
    total = max(lengths)
    theirs = _run(_session(_gqa_model(), None), qkv, key, value, lengths, total)
    ours = _run(_ours(library), qkv, key, value, lengths, total)
    diffs = [float(np.abs(a - b).max()) for a, b in zip(ours, theirs, strict=True)]
    rel = diffs[0] / float(np.abs(theirs[0]).max())
    print(f"B={batch} S={seq} past {past[:4]}...: max |diff| out {diffs[0]:.2e} (rel {rel:.1e}), KV {diffs[1:]}")
    assert max(diffs) < ATOL
    for row, p in enumerate(past):  # nothing outside the chunk's positions was written
        for mine, before in ((ours[1], key), (ours[2], value)):
            assert np.array_equal(mine[row, :, :p], before[row, :, :p])
            assert np.array_equal(mine[row, :, p + seq :], before[row, :, p + seq :])


@pytest.mark.parametrize("scale", [0.2, 0.0])
def test_the_scale_attribute_is_read(library: Path, scale: float) -> None:
    qkv, key, value = _data(2, 1, seed=7)
    theirs = _run(_session(_gqa_model(scale=scale), None), qkv, key, value, [40, 90], 90)
    ours = _run(_ours(library, scale=scale), qkv, key, value, [40, 90], 90)
    assert float(np.abs(ours[0] - theirs[0]).max()) < ATOL


def test_each_row_is_bit_for_bit_the_same_alone_with_others_and_at_any_thread_count(library: Path) -> None:
    past = [0, 5, 8, 30, 64, 100, 101, 150, 7, 200, 255, 1, 99, 100, 100, 17]
    qkv, key, value = _data(16, 1, seed=3)
    lengths = [p + 1 for p in past]
    sessions = {threads: _ours(library, threads) for threads in (1, 2, 3)}
    together = _run(sessions[2], qkv, key, value, lengths, max(lengths))
    for threads, session in sessions.items():
        again = _run(session, qkv, key, value, lengths, max(lengths))
        assert all(np.array_equal(a, b) for a, b in zip(again, together, strict=True)), threads
    for row in range(16):
        alone = _run(sessions[1], qkv[row : row + 1], key[row : row + 1], value[row : row + 1], [lengths[row]], CAP)
        for mine, theirs in zip(alone, together, strict=True):
            assert np.array_equal(mine[0], theirs[row]), row
    # prefill: rows of a first-prompt call of three, each alone
    qkv, key, value = _data(3, 24, seed=4)
    together = _run(sessions[2], qkv, key, value, [24] * 3, 24)
    for row in range(3):
        alone = _run(sessions[1], qkv[row : row + 1], key[row : row + 1], value[row : row + 1], [24], 24)
        assert all(np.array_equal(mine[0], theirs[row]) for mine, theirs in zip(alone, together, strict=True))


def test_separate_present_buffers_and_padded_rows_fail_with_a_message(library: Path) -> None:
    session = _ours(library)
    qkv, key, value = _data(1, 1, seed=5)
    feeds = {"qkv": qkv, "pk": key, "pv": value, "sk": np.array([9], np.int32), "tl": np.array(10, np.int32)}
    with pytest.raises(Exception, match="same buffers as past_key/past_value"):
        session.run(None, feeds)
    qkv, key, value = _data(2, 8, seed=6)
    with pytest.raises(Exception, match="at least the query length"):
        _run(session, qkv, key, value, [8, 5], 8)  # a right-padded first prompt
    with pytest.raises(Exception, match="capacity"):
        _run(session, qkv[:1, :1], key[:1], value[:1], [CAP + 1], CAP + 1)


@pytest.mark.parametrize(
    "attrs",
    [{"rotary_interleaved": 1}, {"local_window_size": 16}, {"do_rotary": 0}, {"softcap": 30.0}, {"smooth_softmax": 1}],
)
def test_nodes_with_other_attributes_stay(attrs: dict[str, float | int]) -> None:
    model = _gqa_model(**attrs)
    assert use_attention_op(model) == 0
    assert model.graph.node[0].op_type == "GroupQueryAttention"


def test_a_prompt_gives_the_same_bits_in_one_chunk_in_pieces_or_one_position_at_a_time(library: Path) -> None:
    session = _ours(library)
    qkv, key, value = _data(1, 70, seed=8)
    whole = _run(session, qkv, key, value, [70], 70)
    for cut in ([30, 40], [1] * 70, [17, 1, 52]):
        k, v, outs, start = key.copy(), value.copy(), [], 0
        for size in cut:
            end = start + size
            out, k, v = _run(session, qkv[:, start:end], k, v, [end], end)
            outs.append(out)
            start = end
        assert np.array_equal(np.concatenate(outs, axis=1), whole[0]), cut
        assert np.array_equal(k, whole[1]) and np.array_equal(v, whole[2])
