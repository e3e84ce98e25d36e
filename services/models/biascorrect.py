"""Bias correction of the INT4 edge model: each MatMulNBits gets ``bias = (W - W_q) @ E[x]``.

Why: the source weights are GGUF Q4_1 blocks (``d·q + m``), but MatMulNBits' integer zero points
cannot hold ``m/d``, so every int4 block of the edge model is shifted by up to half a step. The shift
is systematic, and on the activations' mean it biases every output; re-quantizing all layers to 8 bits
removes the loss (+0.4 % perplexity) but reads twice the bytes per token. Adding the expected error
``(W - W_q) @ E[x]`` as the node's bias (Nagel et al., "Data-Free Quantization Through Weight
Equalization and Bias Correction", 2019) costs nothing at decode time and recovers most of it
(docs/models/quality.md).

``E[x]`` is the mean input of every linear layer of the fp32 (HF) model over a calibration text that
ships with meshserve (``data/calibration_lear.txt``: King Lear, public domain; the held-out eval text is
The Tempest). Offline: torch on CPU, about a minute. Nodes whose names do not follow the model builder's
llama layout, and unquantized MatMuls, are left alone.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

CALIBRATION_TEXT = Path(__file__).parent / "data" / "calibration_lear.txt"
CALIBRATION_TOKENS = 2048
_NODE = re.compile(r"^/model/layers\.(\d+)/(attn|mlp)/(qkv_proj|o_proj|gate_proj|up_proj|down_proj)/MatMul")


def calibrate(
    hf_dir: Path, ids: list[int], threads: int = 0, window: int = 512
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(mean input vector of every ``nn.Linear`` by module name over ``ids`` in float64, the state dict)."""
    import torch
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    sums: dict[str, list[Any]] = {}

    def hook(name: str) -> Any:
        def record(_module: Any, inputs: tuple[Any, ...]) -> None:
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).double()
            entry = sums.setdefault(name, [0.0, 0])
            entry[0] = entry[0] + x.sum(0)
            entry[1] += x.shape[0]

        return record

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(hook(name))
    with torch.inference_mode():
        for start in range(0, len(ids), window):
            model(torch.tensor([ids[start : start + window]]))
    means = {name: (total / count).numpy() for name, (total, count) in sums.items()}
    return means, model.state_dict()


def dequantize(
    attrs: dict[str, Any], packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None
) -> np.ndarray:
    """The float ``[N, K]`` weight a MatMulNBits node computes with (``(q - zp) * scale`` per block)."""
    bits, n, k, block = int(attrs["bits"]), int(attrs["N"]), int(attrs["K"]), int(attrs["block_size"])
    blocks = -(-k // block)
    raw = packed.reshape(n, blocks, -1)
    if bits == 4:
        q = np.stack([raw & 0xF, raw >> 4], axis=-1).reshape(n, blocks, -1)[..., :block].astype(np.float64)
    elif bits == 8:
        q = raw[..., :block].astype(np.float64)
    else:
        raise ValueError(f"MatMulNBits with {bits} bits is not supported")
    if zero_points is None:
        zp = np.full((n, blocks), 2.0 ** (bits - 1))
    elif zero_points.dtype == np.uint8 and bits == 4:
        zp = np.stack([zero_points & 0xF, zero_points >> 4], axis=-1).reshape(n, -1)[:, :blocks].astype(np.float64)
    else:
        zp = zero_points.reshape(n, blocks).astype(np.float64)
    weight = (q - zp[..., None]) * scales.reshape(n, blocks)[..., None].astype(np.float64)
    return weight.reshape(n, blocks * block)[:, :k]


def _source(
    node_name: str, state: dict[str, Any], means: dict[str, np.ndarray]
) -> tuple[np.ndarray, np.ndarray] | None:
    """The fp32 weight ``[N, K]`` and mean input ``[K]`` behind a builder MatMul, or None."""
    if node_name.startswith("/lm_head/MatMul"):
        weight = state.get("lm_head.weight", state.get("model.embed_tokens.weight"))
        return (weight.numpy(), means["lm_head"]) if weight is not None and "lm_head" in means else None
    match = _NODE.match(node_name)
    if match is None:
        return None
    layer, part, proj = match.groups()
    prefix = f"model.layers.{layer}.{'self_attn' if part == 'attn' else 'mlp'}."
    if proj == "qkv_proj":
        names = [f"{prefix}{x}_proj.weight" for x in "qkv"]
        if any(n not in state for n in names) or f"{prefix}q_proj" not in means:
            return None
        return np.concatenate([state[n].numpy() for n in names], axis=0), means[f"{prefix}q_proj"]
    weight = state.get(f"{prefix}{proj}.weight")
    key = f"{prefix}{proj}"
    return (weight.numpy(), means[key]) if weight is not None and key in means else None


def correct(edge_dir: Path, hf_dir: Path, *, text: str | None = None, threads: int = 0) -> int:
    """Add bias correction to every quantized MatMul of ``edge_dir/model.onnx`` (in place); returns how many."""
    import onnx
    from onnx import numpy_helper
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(hf_dir / "tokenizer.json")).encode(text or CALIBRATION_TEXT.read_text()).ids
    means, state = calibrate(hf_dir, list(ids[:CALIBRATION_TOKENS]), threads)
    graph_path = edge_dir / "model.onnx"
    model = onnx.load(str(graph_path))
    inits = {init.name: init for init in model.graph.initializer}
    added = []
    for node in model.graph.node:
        if node.op_type != "MatMulNBits" or (source := _source(node.name, state, means)) is None:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        arrays = [numpy_helper.to_array(inits[name]) if name in inits else None for name in list(node.input)[1:4]]
        packed, scales, zero_points = [*arrays, None, None][:3]
        assert packed is not None and scales is not None
        weight, mean = source
        bias = ((weight.astype(np.float64) - dequantize(attrs, packed, scales, zero_points)) @ mean).astype(np.float32)
        inputs = [*node.input, *[""] * (6 - len(node.input))]
        if inputs[5] in inits:  # the node already has a bias: add to it
            bias = bias + numpy_helper.to_array(inits[inputs[5]]).astype(np.float32)
        name = f"{node.name.strip('/').replace('/', '.')}.bias_correction"
        added.append(numpy_helper.from_array(bias, name))
        inputs[5] = name
        del node.input[:]
        node.input.extend(inputs)
    model.graph.initializer.extend(added)
    data = graph_path.with_name(graph_path.name + ".data")
    data.unlink(missing_ok=True)  # everything is in memory; onnx appends to an existing data file
    onnx.save(model, str(graph_path), save_as_external_data=True, all_tensors_to_one_file=True, location=data.name)
    return len(added)
