"""Graph edit for ``int4_kernel=native``: the MatMulNBits nodes become our custom op ``Int4MatMul``.

The 4-bit nodes in blocks of 32 (no g_idx; the ones MLAS computes differently for one row and several,
docs/edge.md, issue 27) and the 8-bit ones in blocks of 32 (MLAS is row-invariant there, ours 1.2-1.6x faster;
the op's ``bits`` attribute says which) are replaced; the LM head (``logits``) stays. Each replaced node's
weights, scales and zero points are packed here into the kernel's layout
(:func:`services.edge_worker.native.kernel.pack_weights`) as one new uint8 initializer, inline in the
edited graph (the load cache keeps it); its bias (the builder's bias correction) stays an input.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import external_data_helper, helper, numpy_helper

from services.edge_worker.native.kernel import BITS, BLOCK, GROUP_COLUMNS, pack_weights

DOMAIN = "meshserve.edge"
OP = "Int4MatMul"


def _replaceable(node: onnx.NodeProto) -> dict[str, int] | None:
    if node.op_type != "MatMulNBits" or node.domain != "com.microsoft" or "logits" in node.output:
        return None
    attrs = {a.name: int(helper.get_attribute_value(a)) for a in node.attribute if a.type == onnx.AttributeProto.INT}
    inputs = [*node.input, *[""] * (6 - len(node.input))]
    bits = attrs.get("bits", 4)
    if bits not in BITS or attrs.get("block_size") != BLOCK or inputs[4]:
        return None
    k, n = attrs.get("K", 0), attrs.get("N", 0)
    if k <= 0 or k % BLOCK or n <= 0 or n % GROUP_COLUMNS:
        return None
    return {"K": k, "N": n, "bits": bits}


def use_int4_op(model: onnx.ModelProto, base: Path, threads: int) -> int:
    """Replace the 4- and 8-bit block-32 MatMulNBits of ``model`` (in place) by ``Int4MatMul`` nodes; returns how
    many were replaced. ``threads``: the session's intra-op threads (the op cuts its columns into 4 chunks
    per thread for onnxruntime's pool). ``base``: the model directory (external data)."""
    graph = model.graph
    inits = {init.name: init for init in graph.initializer}

    def array(name: str) -> np.ndarray | None:
        if not name:
            return None
        init = inits.get(name)
        if init is None:
            raise ValueError(f"the MatMulNBits input {name!r} is not an initializer")
        if external_data_helper.uses_external_data(init):
            external_data_helper.load_external_data_for_tensor(init, str(base))
        return numpy_helper.to_array(init)

    added: list[onnx.TensorProto] = []
    replaced = 0
    for index, node in enumerate(list(graph.node)):
        shape = _replaceable(node)
        if shape is None:
            continue
        k, n, bits = shape["K"], shape["N"], shape["bits"]
        inputs = [*node.input, *[""] * (6 - len(node.input))]
        b, scales, zeros, bias = (array(name) for name in (inputs[1], inputs[2], inputs[3], inputs[5]))
        assert b is not None and scales is not None
        packed_name, bias_name = f"{inputs[1]}/int4op", f"{node.name or inputs[1]}/int4op_bias"
        blob = b.reshape(n, k // BLOCK, BLOCK * bits // 8)
        packed = pack_weights(blob, scales.astype(np.float32), None if zeros is None else zeros.reshape(-1), k, n, bits)
        added.append(numpy_helper.from_array(np.ascontiguousarray(packed), packed_name))
        added.append(
            numpy_helper.from_array(np.zeros(n, np.float32) if bias is None else bias.astype(np.float32), bias_name)
        )
        custom = helper.make_node(
            OP, [inputs[0], packed_name, bias_name], list(node.output), name=f"{node.name}/int4op",
            domain=DOMAIN, K=k, N=n, threads=max(1, threads), bits=bits,
        )  # fmt: skip
        graph.node.remove(node)
        graph.node.insert(index, custom)
        replaced += 1
    used = {name for node in graph.node for name in node.input}
    kept = [init for init in graph.initializer if init.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    graph.initializer.extend(added)
    if replaced and not any(op.domain == DOMAIN for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return replaced
