"""The edit :mod:`services.edge_worker.graph` loads: the builder's decoder with its LM head applied to the
last :data:`LAST_POSITIONS` positions only, and the optional int8 head and native ops (why: that
module's docstring).

Only a load that misses the load cache imports this module and with it ``onnx`` (about 12 MiB resident
and a second of imports): a worker that starts or wakes from the cached graph never does.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import structlog
from onnx import external_data_helper, helper, numpy_helper
from tokenizers import Tokenizer

from services.edge_worker.int8head import CALIBRATION_TOKENS, int8_lm_head, outlier_channels
from services.edge_worker.native import attention_graph, swiglu_graph
from services.edge_worker.native import graph as native_graph
from services.edge_worker.native.kernel import kernel_threads
from services.models.biascorrect import CALIBRATION_TEXT

log = structlog.get_logger(__name__)

LAST_POSITIONS = 2


def _last_positions(model: onnx.ModelProto) -> None:
    graph = model.graph
    head = next((node for node in graph.node if "logits" in node.output), None)
    if head is None:
        raise ValueError("the decoder graph has no node producing 'logits'")
    hidden = head.input[0]
    sliced = f"{hidden}/last_positions"
    names = ("last_positions_starts", "last_positions_ends", "last_positions_axes")
    values = (-LAST_POSITIONS, np.iinfo(np.int64).max, 1)
    for name, value in zip(names, values, strict=True):
        graph.initializer.append(numpy_helper.from_array(np.array([value], dtype=np.int64), name))
    index = list(graph.node).index(head)
    graph.node.insert(index, helper.make_node("Slice", [hidden, *names], [sliced], name="/lm_head/LastPositions"))
    head.input[0] = sliced
    for output in graph.output:
        if output.name == "logits":
            output.type.tensor_type.shape.dim[1].dim_param = "last_positions"


def edited_model(
    model_path: Path,
    options: ort.SessionOptions,
    *,
    lm_head: str,
    int4_kernel: str = "mlas",
    last_positions: bool = True,
) -> onnx.ModelProto:
    """The graph :func:`load_session` runs (``options`` must name the external data folder: the
    calibration run reads the weights); ``last_positions=False`` leaves out the slice to the last
    :data:`LAST_POSITIONS` positions."""
    model = onnx.load(str(model_path), load_external_data=False)
    outliers = None
    if lm_head == "int8":
        tokenizer = Tokenizer.from_file(str(model_path.parent / "tokenizer.json"))
        ids = tokenizer.encode(CALIBRATION_TEXT.read_text()).ids[:CALIBRATION_TOKENS]
        decoder = json.loads((model_path.parent / "genai_config.json").read_text())["model"]["decoder"]
        outliers = outlier_channels(model, options, list(ids), int(decoder["head_size"]))
    if last_positions:
        _last_positions(model)
    if lm_head == "int8" and not int8_lm_head(model, model_path.parent, outliers):
        raise ValueError(f"lm_head 'int8' needs an 8-bit MatMulNBits LM head, which {model_path} does not have")
    if int4_kernel == "native":
        replaced = native_graph.use_int4_op(model, model_path.parent, kernel_threads(options.intra_op_num_threads))
        log.info("edge_int4_native_op", replaced=replaced, swiglu_fused=swiglu_graph.use_swiglu_op(model))
        log.info("edge_native_attention_op", replaced=attention_graph.use_attention_op(model))
    return model


def external_weights(
    model: onnx.ModelProto, base: Path, location: str, *, align: int, inline_limit: int
) -> tuple[bytes, list[tuple[int, bytes]]]:
    """``model`` serialized with every raw initializer over ``inline_limit`` bytes stored as external data in
    ``location`` (those still in ``base``'s external data files are read from there), each at a
    multiple of ``align``; and the (offset, bytes) to write there (the load cache's entry format,
    load_cache.py). ``model`` is left with every weight inline."""
    moved: list[tuple[onnx.TensorProto, int, bytes]] = []
    end = 0
    for init in model.graph.initializer:
        if external_data_helper.uses_external_data(init):
            external_data_helper.load_external_data_for_tensor(init, str(base))
        if not init.HasField("raw_data") or len(init.raw_data) <= inline_limit:
            continue  # typed fields (float_data, ...) stay inline too, as onnx's own saver keeps them
        data = init.raw_data
        offset = -(-end // align) * align
        moved.append((init, offset, data))
        end = offset + len(data)
        init.ClearField("raw_data")
        init.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", location), ("offset", str(offset)), ("length", str(len(data)))):
            entry = init.external_data.add()
            entry.key, entry.value = key, value
    graph = model.SerializeToString()
    for init, _offset, data in moved:  # back inline: a caller whose cache write fails loads it as it is
        del init.external_data[:]
        init.data_location = onnx.TensorProto.DEFAULT
        init.raw_data = data
    return graph, [(offset, data) for _init, offset, data in moved]
