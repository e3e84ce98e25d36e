"""The LM head on onnxruntime's int8 GEMM (MLAS QGEMM) instead of an 8-bit MatMulNBits.

Why: the builder's lm_head is a 49152 x 576 MatMulNBits with 8-bit blocks of 32. On an AVX2 CPU
without VNNI its int8-activation kernel for several rows is slow: 18.8 ms of CPU for 16 rows, while
MLAS' QGEMM does the same product in 8.6 ms (one thread, the head alone), and 2.1 vs 2.5 ms for one
row (docs/edge.md). So the head is rewritten, in memory at load time, as

    x_rest = x with the outlier channels zeroed;  scale = max|x_rest| / 127 per row
    x_u8 = round(x_rest / scale) + 128
    logits = MatMulIntegerToFloat(x_u8, W_u8, 1, w_scale, 128, w_zero) * scale
             + x[outliers] @ W[outliers] (fp32) + bias

with ``W_u8`` the node's own weight (dequantized from its 8-bit blocks) re-quantized to uint8 with
one scale and zero point per output column. Every row is quantized on its own and the integer
product is exact (uint8 x uint8: MLAS widens to 16 bits, no saturation), so a row's logits do not
depend on the other rows of the call, nor on how many there are (batch invariance holds for the head;
the rest of the graph is unchanged). The bias correction of the node (``services.models.biascorrect``)
is kept as the bias.

Outlier channels: MatMulNBits quantizes the activations per block of 32, this per row of 576, and
the head's input has a few channels an order of magnitude larger than the rest on every token (row
max ~22 vs RMS ~1.8). Quantizing them with the rest cost a point of perplexity (+9.0 % vs +8.0 %
over fp32 on the held-out text); taking the 16 largest (found at load time on 128 tokens of the
calibration text, :func:`outlier_channels`) out of the int8 product and into a small fp32 MatMul
gives +7.9 %, at almost no cost (docs/edge.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import external_data_helper, helper, numpy_helper

_ATTRS = ("K", "N", "bits", "block_size")


def _array(graph: onnx.GraphProto, name: str, base: Path) -> np.ndarray | None:
    if not name:
        return None
    init = next((i for i in graph.initializer if i.name == name), None)
    if init is None:
        raise ValueError(f"the LM head's input {name!r} is not an initializer")
    if external_data_helper.uses_external_data(init):
        external_data_helper.load_external_data_for_tensor(init, str(base))
    return numpy_helper.to_array(init)


def _dequantize8(attrs: dict[str, Any], packed: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None) -> np.ndarray:
    """``biascorrect.dequantize`` for 8 bits in float32 (a third of the time for a 49152 x 576 head)."""
    n, k, block = int(attrs["N"]), int(attrs["K"]), int(attrs["block_size"])
    blocks = -(-k // block)
    q = packed.reshape(n, blocks, block).astype(np.float32)
    zp = np.full((n, blocks), 128.0, dtype=np.float32) if zeros is None else zeros.reshape(n, blocks).astype(np.float32)
    q -= zp[..., None]
    q *= scales.reshape(n, blocks, 1).astype(np.float32)
    return q.reshape(n, blocks * block)[:, :k]


def quantize_columns(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``[N, K]`` float -> (uint8 ``[K, N]``, scale ``[N]``, zero point ``[N]``), asymmetric per column."""
    lo = np.minimum(weight.min(axis=1), 0.0)
    hi = np.maximum(weight.max(axis=1), 0.0)
    scale = np.where(hi > lo, (hi - lo) / 255.0, 1.0)
    zero = np.clip(np.round(-lo / scale), 0, 255)
    q = np.clip(np.round(weight / scale[:, None]) + zero[:, None], 0, 255).astype(np.uint8)
    return np.ascontiguousarray(q.T), scale.astype(np.float32), zero.astype(np.uint8)


def int8_lm_head(model: onnx.ModelProto, base: Path, outliers: np.ndarray | None = None) -> bool:
    """Replace the 8-bit MatMulNBits producing ``logits`` (in place); False if the head is something else.

    ``base``: the model directory (the weights are external data there). ``outliers``: input channels
    computed in fp32 instead (their activations dwarf the rest, see :func:`outlier_channels`).
    """
    graph = model.graph
    head = next((node for node in graph.node if "logits" in node.output), None)
    if head is None or head.op_type != "MatMulNBits":
        return False
    attrs = {a.name: helper.get_attribute_value(a) for a in head.attribute}
    if int(attrs.get("bits", 4)) != 8 or any(key not in attrs for key in _ATTRS):
        return False
    inputs = [*head.input, *[""] * (6 - len(head.input))]
    if inputs[4]:  # g_idx (act-order) is not supported here
        return False
    packed, scales, zeros = (_array(graph, name, base) for name in inputs[1:4])
    assert packed is not None and scales is not None
    bias = _array(graph, inputs[5], base)
    full = _dequantize8(attrs, packed, scales, zeros)
    out = np.asarray(outliers if outliers is not None else [], dtype=np.int64)
    keep = np.ones(full.shape[1], dtype=np.float32)
    keep[out] = 0.0
    weight, w_scale, w_zero = quantize_columns(full * keep)

    p = "/lm_head/int8"
    consts: dict[str, np.ndarray] = {
        f"{p}/axes": np.array([-1], dtype=np.int64),
        f"{p}/inv127": np.array(1.0 / 127.0, dtype=np.float32),
        f"{p}/tiny": np.array(1e-30, dtype=np.float32),
        f"{p}/-127": np.array(-127.0, dtype=np.float32),
        f"{p}/127": np.array(127.0, dtype=np.float32),
        f"{p}/128": np.array(128.0, dtype=np.float32),
        f"{p}/one": np.array(1.0, dtype=np.float32),
        f"{p}/x_zero": np.array(128, dtype=np.uint8),
        f"{p}/weight": weight,
        f"{p}/w_scale": w_scale,
        f"{p}/w_zero": w_zero,
    }
    x = inputs[0]
    nodes: list[onnx.NodeProto] = []
    if out.size:  # outlier channels: zero in the int8 product, added back from an fp32 MatMul
        consts[f"{p}/keep"] = keep
        consts[f"{p}/outliers"] = out
        consts[f"{p}/outlier_weight"] = np.ascontiguousarray(full[:, out].T)
        nodes += [
            helper.make_node("Gather", [x, f"{p}/outliers"], [f"{p}/x_out"], axis=-1),
            helper.make_node("MatMul", [f"{p}/x_out", f"{p}/outlier_weight"], [f"{p}/y_out"]),
            helper.make_node("Mul", [x, f"{p}/keep"], [f"{p}/x_rest"]),
        ]
        x = f"{p}/x_rest"
    nodes += [
        helper.make_node("Abs", [x], [f"{p}/abs"]),
        helper.make_node("ReduceMax", [f"{p}/abs", f"{p}/axes"], [f"{p}/max"], keepdims=1),
        helper.make_node("Mul", [f"{p}/max", f"{p}/inv127"], [f"{p}/scale0"]),
        helper.make_node("Max", [f"{p}/scale0", f"{p}/tiny"], [f"{p}/scale"]),
        helper.make_node("Div", [x, f"{p}/scale"], [f"{p}/div"]),
        helper.make_node("Round", [f"{p}/div"], [f"{p}/round"]),
        helper.make_node("Clip", [f"{p}/round", f"{p}/-127", f"{p}/127"], [f"{p}/q"]),
        helper.make_node("Add", [f"{p}/q", f"{p}/128"], [f"{p}/shifted"]),
        helper.make_node("Cast", [f"{p}/shifted"], [f"{p}/xq"], to=onnx.TensorProto.UINT8),
        helper.make_node(
            "MatMulIntegerToFloat",
            [f"{p}/xq", f"{p}/weight", f"{p}/one", f"{p}/w_scale", f"{p}/x_zero", f"{p}/w_zero"],
            [f"{p}/product"],
            domain="com.microsoft",
            name=f"{p}/MatMulIntegerToFloat",
        ),
        helper.make_node("Mul", [f"{p}/product", f"{p}/scale"], [f"{p}/scaled"]),
    ]
    result = f"{p}/scaled"
    if out.size:
        nodes.append(helper.make_node("Add", [result, f"{p}/y_out"], [f"{p}/with_outliers"]))
        result = f"{p}/with_outliers"
    if bias is not None:
        consts[f"{p}/bias"] = bias.astype(np.float32)
        nodes.append(helper.make_node("Add", [result, f"{p}/bias"], ["logits"]))
    else:
        nodes.append(helper.make_node("Identity", [result], ["logits"]))
    index = list(graph.node).index(head)
    graph.node.remove(head)
    for offset, node in enumerate(nodes):
        graph.node.insert(index + offset, node)
    used = {name for node in graph.node for name in node.input}
    kept = [init for init in graph.initializer if init.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    graph.initializer.extend(numpy_helper.from_array(value, name) for name, value in consts.items())
    if not any(op.domain == "com.microsoft" for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return True


OUTLIER_CHANNELS = 16
CALIBRATION_TOKENS = 128


def outlier_channels(
    model: onnx.ModelProto,
    options: ort.SessionOptions,
    ids: list[int],
    head_size: int,
    count: int = OUTLIER_CHANNELS,
) -> np.ndarray:
    """The ``count`` input channels of the LM head with the largest activations over ``ids``.

    Runs ``model`` (the builder's graph, unedited, its external data folder set in ``options``) once
    on ``ids`` with its head's input as an extra output (``head_size``: of its KV inputs). The
    channels are a property of the model (a few residual-stream channels are an order of magnitude
    larger than the rest on every token), so a short text finds them.
    """
    head = next((node for node in model.graph.node if "logits" in node.output), None)
    if head is None:
        raise ValueError("the decoder graph has no node producing 'logits'")
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.append(helper.make_tensor_value_info(head.input[0], onnx.TensorProto.FLOAT, None))
    session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds: dict[str, np.ndarray] = {
        "input_ids": np.array([ids], dtype=np.int64),
        "attention_mask": np.ones((1, len(ids)), dtype=np.int64),
    }
    for graph_input in probe.graph.input:
        if graph_input.name.startswith("past_key_values."):
            kv_heads = graph_input.type.tensor_type.shape.dim[1].dim_value
            feeds[graph_input.name] = np.zeros((1, kv_heads, 0, head_size), dtype=np.float32)
    (hidden,) = session.run([head.input[0]], feeds)
    peak = np.abs(np.asarray(hidden)).reshape(-1, np.shape(hidden)[-1]).max(axis=0)
    return np.sort(np.argsort(-peak, kind="stable")[:count])
