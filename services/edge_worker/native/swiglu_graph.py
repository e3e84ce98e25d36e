"""Graph edit after :func:`services.edge_worker.native.graph.use_int4_op`: each MLP's gate and up projections
and their SwiGLU become one ``Int4MatMul`` node with ``act=1``.

The builder's MLP is ``down(Mul(Mul(G, Sigmoid(G)), U))`` with ``G = gate(x)`` and ``U = up(x)``, two
4-bit matmuls of the same input. One node instead of five: the input is quantized once, one pool dispatch
instead of two matmuls and three elementwise nodes, and the ``[rows, 2 x 1536]`` intermediate never
leaves the op. The two packed weight matrices are interleaved by groups of 8 columns (gate group g, then
up group g), and so are their biases, so every chunk of the op's threads holds whole (gate, up) pairs and
applies the activation itself, in the order of the nodes it replaces (int4op.c). Rows stay independent.
Only the exact pattern is fused (each intermediate used by the pattern alone, 4-bit, the same input, K
and N); anything else is left as it is.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import helper, numpy_helper

from services.edge_worker.native.graph import DOMAIN, OP
from services.edge_worker.native.kernel import GROUP_COLUMNS


def _attrs(node: onnx.NodeProto) -> dict[str, int]:
    return {a.name: int(helper.get_attribute_value(a)) for a in node.attribute if a.type == onnx.AttributeProto.INT}


def _plain_int4(node: onnx.NodeProto | None) -> bool:
    if node is None or (node.domain, node.op_type) != (DOMAIN, OP):
        return False
    attrs = _attrs(node)
    return attrs.get("bits", 4) == 4 and attrs.get("act", 0) == 0


def _interleaved(inits: dict[str, onnx.TensorProto], gate: str, up: str, groups: int, name: str) -> onnx.TensorProto:
    """The gate's and the up projection's arrays (packed weights or biases) by groups of 8 columns, alternating."""
    g_arr = numpy_helper.to_array(inits[gate]).reshape(groups, -1)
    u_arr = numpy_helper.to_array(inits[up]).reshape(groups, -1)
    return numpy_helper.from_array(np.ascontiguousarray(np.stack([g_arr, u_arr], axis=1).reshape(-1)), name)


def use_swiglu_op(model: onnx.ModelProto) -> int:
    """Fuse every gate/up/SwiGLU of ``model`` (in place) into one ``Int4MatMul`` with ``act=1``; returns how
    many MLPs were fused."""
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    uses: dict[str, int] = defaultdict(int)
    for node in graph.node:
        for name in node.input:
            uses[name] += 1
    for output in graph.output:
        uses[output.name] += 1  # a graph output is never an intermediate to drop
    inits = {init.name: init for init in graph.initializer}
    fused = 0
    for mul in list(graph.node):
        if mul.op_type != "Mul" or mul.domain not in ("", "ai.onnx") or len(mul.input) != 2:
            continue
        for act_name, up_name in ((mul.input[0], mul.input[1]), (mul.input[1], mul.input[0])):
            act, up = producers.get(act_name), producers.get(up_name)
            if act is None or act.op_type != "Mul" or len(act.input) != 2 or not _plain_int4(up):
                continue
            pair = [(act.input[0], act.input[1]), (act.input[1], act.input[0])]
            found = [(g, s) for g, s in pair if (sig := producers.get(s)) is not None and sig.op_type == "Sigmoid"]
            if not found:
                continue
            gate_name, sig_name = found[0]
            sig, gate = producers[sig_name], producers.get(gate_name)
            if sig.input[0] != gate_name or not _plain_int4(gate) or gate is up:
                continue
            assert gate is not None and up is not None
            g_attrs, u_attrs = _attrs(gate), _attrs(up)
            if gate.input[0] != up.input[0] or (g_attrs["K"], g_attrs["N"]) != (u_attrs["K"], u_attrs["N"]):
                continue
            if (uses[gate_name], uses[sig_name], uses[act_name], uses[up_name]) != (2, 1, 1, 1):
                continue
            if not all(name in inits for name in (*gate.input[1:3], *up.input[1:3])):
                continue
            n, groups = g_attrs["N"], g_attrs["N"] // GROUP_COLUMNS

            weights = _interleaved(inits, gate.input[1], up.input[1], groups, f"{gate.input[1]}/swiglu")
            bias = _interleaved(inits, gate.input[2], up.input[2], groups, f"{gate.input[2]}/swiglu")
            node = helper.make_node(
                OP, [gate.input[0], weights.name, bias.name], [mul.output[0]], name=f"{gate.name}/swiglu",
                domain=DOMAIN, K=g_attrs["K"], N=2 * n, threads=g_attrs.get("threads", 1), bits=4, act=1,
            )  # fmt: skip
            index = list(graph.node).index(gate)  # before every consumer of the output it takes over
            for old in (gate, up, sig, act, mul):
                graph.node.remove(old)
            graph.node.insert(index, node)
            graph.initializer.extend([weights, bias])
            inits[weights.name], inits[bias.name] = weights, bias
            fused += 1
            break
    if fused:
        used = {name for node in graph.node for name in node.input}
        kept = [init for init in graph.initializer if init.name in used]
        del graph.initializer[:]
        graph.initializer.extend(kept)
    return fused
