"""Graph edit for ``int4_kernel=native``: GroupQueryAttention nodes become our custom op ``Attention`` (``attn.c``).

Our own op because onnxruntime's CPU GroupQueryAttention runs a generic SGEMM per (row, head) for Q K^T and
another for P V, overhead-bound at one query position (docs/edge.md). Only nodes whose attributes are
exactly the cases ``attn.c`` implements are replaced (packed QKV, past and present KV, rotary over the
whole head, not interleaved, no local window, no softcap, no smooth softmax); any other stays as it is.
The op needs past and present KV in one buffer, as the batched engine binds them (``KvSlots``).
"""

from __future__ import annotations

import onnx
from onnx import helper

from services.edge_worker.native.graph import DOMAIN

OP = "Attention"
HEAD_SIZES = range(16, 257, 16)
"""Head sizes the op runs (multiples of 16 up to 256); rotary covers the whole head."""

_FIXED = {  # attribute: (the value the op implements, onnxruntime's default when the node leaves it out)
    "do_rotary": (1, 0),
    "rotary_interleaved": (0, 0),
    "local_window_size": (-1, -1),
    "softcap": (0, 0),
    "smooth_softmax": (0, 0),
}
_FREE = {"num_heads", "kv_num_heads", "scale"}
"""Attributes the op takes over whatever their value; a node with any attribute outside these stays."""


def _widths(graph: onnx.GraphProto) -> dict[str, int]:
    """The last dimension of tensors where the graph fixes it: the output of a matmul node with an ``N``
    attribute (MatMulNBits, Int4MatMul), or a value_info / graph input with a fixed last dimension."""
    widths: dict[str, int] = {}
    for item in [*graph.input, *graph.value_info]:
        dims = item.type.tensor_type.shape.dim
        if dims and dims[-1].HasField("dim_value"):
            widths[item.name] = int(dims[-1].dim_value)
    for node in graph.node:
        for a in node.attribute:
            if a.name == "N" and a.type == onnx.AttributeProto.INT and len(node.output) == 1:
                widths[node.output[0]] = int(a.i)
    return widths


def _replaceable(
    node: onnx.NodeProto, rotary_dims: dict[str, int], widths: dict[str, int]
) -> dict[str, float | int] | None:
    if node.op_type != "GroupQueryAttention" or node.domain != "com.microsoft":
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if set(attrs) - _FREE - set(_FIXED) or "num_heads" not in attrs or "kv_num_heads" not in attrs:
        return None
    if any(attrs.get(name, default) != wanted for name, (wanted, default) in _FIXED.items()):
        return None
    inputs = [*node.input, *[""] * (9 - len(node.input))]
    if len(node.input) > 9 and any(node.input[9:]):  # position_ids, attention_bias, head_sink: not supported
        return None
    if inputs[1] or inputs[2] or not all(inputs[i] for i in (0, 3, 4, 5, 6, 7, 8)) or len(node.output) != 3:
        return None
    if rotary_dims.get(inputs[7]) is None or rotary_dims.get(inputs[7]) != rotary_dims.get(inputs[8]):
        return None
    heads, kv_heads = int(attrs["num_heads"]), int(attrs["kv_num_heads"])
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        return None
    head = 2 * rotary_dims[inputs[7]]  # the rotary dimension: the op needs it to be the head size
    if head not in HEAD_SIZES or widths.get(inputs[0]) != (heads + 2 * kv_heads) * head:
        return None
    return {"num_heads": heads, "kv_num_heads": kv_heads, "scale": float(attrs.get("scale", 0.0))}


def use_attention_op(model: onnx.ModelProto) -> int:
    """Replace the supported GroupQueryAttention nodes of ``model`` (in place) by ``Attention`` nodes (same
    inputs less the two empty key/value ones, same outputs); returns how many were replaced. The cos/sin
    caches must be initializers (their width fixes the rotary dimension) and the packed QKV's width known
    (:func:`_widths`) and equal to (num_heads + 2 kv_num_heads) x the rotary dimension."""
    graph = model.graph
    rotary_dims = {
        init.name: int(init.dims[1]) for init in graph.initializer if len(init.dims) == 2 and init.data_type == 1
    }
    widths = _widths(graph)
    replaced = 0
    for index, node in enumerate(list(graph.node)):
        attrs = _replaceable(node, rotary_dims, widths)
        if attrs is None:
            continue
        inputs = [node.input[0], *node.input[3:9]]
        custom = helper.make_node(OP, inputs, list(node.output), name=f"{node.name}/attention", domain=DOMAIN)
        custom.attribute.extend(helper.make_attribute(name, value) for name, value in attrs.items())
        graph.node.remove(node)
        graph.node.insert(index, custom)
        replaced += 1
    if replaced and not any(op.domain == DOMAIN for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return replaced
