"""INT4 choices for the edge model (onnxruntime-genai's model builder, MatMulNBits on CPU).

One typed object, :class:`Int4Options`, turned into the builder's ``--extra_options``:

* ``block_size``: weights per quantization block along K (16/32/64/128/256). The default GGUF
  source is Q4_1 with blocks of 32, so 32 lines up with the grid the weights already lie on.
* ``symmetric``: signed int4 around zero (``is_symmetric=true``) or uint4 with a zero point per
  block (asymmetric, like Q4_1's scale + min).
* ``accuracy_level``: the activations' type inside MatMulNBits: 4 = int8 (fast CPU kernels),
  1 = fp32 (exact but several times slower here), 2 = fp16, 3 = bf16.
* ``lm_head``: ``int4``, ``int8`` or ``fp32`` (not quantized); ``embeddings``: ``fp32`` or ``int4``.
* ``sensitive_int8``: keep the most quantization-sensitive MatMuls 8-bit (the builder's
  ``mixed_layers`` selector, llama.cpp's mixed strategy: the first and last eighth of the layers plus
  every third layer's qkv/v/down projections).
* ``bias_correction``: after the build, give every quantized MatMul the bias ``(W - W_q) @ E[x]``
  (mean inputs from a calibration text; :mod:`services.models.biascorrect`): the integer zero
  points shift each int4 block of the Q4_1 source, and this removes most of that error at no decode
  cost.

Embeddings and lm_head are always exported untied (``shared_embeddings=false``): the builder's tied
export is broken for asymmetric INT4 (it feeds uint8 into a float Reshape), and untied fp32
embeddings are a gather (no compute), so only memory is at stake.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Any

BLOCK_SIZES = (16, 32, 64, 128, 256)
ACCURACY_LEVELS = (1, 2, 3, 4)
LM_HEAD = ("int4", "int8", "fp32")
EMBEDDINGS = ("fp32", "int4")


@dataclass(frozen=True)
class Int4Options:
    """How the edge model is quantized (see the module docstring for each field)."""

    block_size: int = 32
    symmetric: bool = False
    accuracy_level: int = 4
    lm_head: str = "int8"
    embeddings: str = "fp32"
    sensitive_int8: bool = True
    bias_correction: bool = True

    def __post_init__(self) -> None:
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block size {self.block_size} is not one of {BLOCK_SIZES}")
        if self.accuracy_level not in ACCURACY_LEVELS:
            raise ValueError(f"accuracy level {self.accuracy_level} is not one of {ACCURACY_LEVELS}")
        if self.lm_head not in LM_HEAD:
            raise ValueError(f"lm_head {self.lm_head!r} is not one of {LM_HEAD}")
        if self.embeddings not in EMBEDDINGS:
            raise ValueError(f"embeddings {self.embeddings!r} is not one of {EMBEDDINGS}")

    def extra_options(self) -> list[str]:
        """``key=value`` items for the builder's ``--extra_options``."""
        items = [
            f"block_size={self.block_size}",
            f"is_symmetric={str(self.symmetric).lower()}",
            f"accuracy_level={self.accuracy_level}",
            "shared_embeddings=false",
        ]
        if self.embeddings == "int4":
            items.append("op_types_to_quantize=MatMul/Gather")
        mixed = ["mixed_layers:int8"] if self.sensitive_int8 else []
        if self.lm_head == "int8":
            mixed.insert(0, "last_matmul:int8")
        elif self.lm_head == "fp32":
            items.append("nodes_to_exclude=/lm_head/MatMul")
        if mixed:
            items.append("matmul_mixed_precision=" + ",".join(mixed))
        return items

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def label(self) -> str:
        sym = "sym" if self.symmetric else "asym"
        return (
            f"int4 {sym} block {self.block_size}, accuracy level {self.accuracy_level}, "
            f"lm_head {self.lm_head}, embeddings {self.embeddings}"
            + (", sensitive layers int8" if self.sensitive_int8 else "")
            + (", bias-corrected" if self.bias_correction else "")
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--int4-*`` options (shared by ``models prepare`` and ``distill``)."""
    d = Int4Options()
    group = parser.add_argument_group("INT4 quantization of the edge model")
    group.add_argument(
        "--int4-block-size", type=int, choices=BLOCK_SIZES, default=d.block_size, help="(default %(default)s)"
    )
    group.add_argument(
        "--int4-symmetric",
        action=argparse.BooleanOptionalAction,
        default=d.symmetric,
        help="signed int4 without zero points (default: asymmetric, like the Q4_1 source)",
    )
    group.add_argument(
        "--int4-accuracy-level",
        type=int,
        choices=ACCURACY_LEVELS,
        default=d.accuracy_level,
        help="MatMulNBits activation type: 4=int8 (fast), 1=fp32 (default %(default)s)",
    )
    group.add_argument("--int4-lm-head", choices=LM_HEAD, default=d.lm_head, help="(default %(default)s)")
    group.add_argument("--int4-embeddings", choices=EMBEDDINGS, default=d.embeddings, help="(default %(default)s)")
    group.add_argument(
        "--int4-sensitive-int8",
        action=argparse.BooleanOptionalAction,
        default=d.sensitive_int8,
        help="keep the most quantization-sensitive MatMuls 8-bit (default: on)",
    )
    group.add_argument(
        "--int4-bias-correction",
        action=argparse.BooleanOptionalAction,
        default=d.bias_correction,
        help="add each quantized MatMul's expected error on calibration text as its bias (default: on)",
    )


def from_args(args: argparse.Namespace) -> Int4Options:
    return Int4Options(
        block_size=args.int4_block_size,
        symmetric=args.int4_symmetric,
        accuracy_level=args.int4_accuracy_level,
        lm_head=args.int4_lm_head,
        embeddings=args.int4_embeddings,
        sensitive_int8=args.int4_sensitive_int8,
        bias_correction=args.int4_bias_correction,
    )
