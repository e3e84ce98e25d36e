"""Our row-invariant int4 x int8 matmul kernel (AVX2), benchmarked against onnxruntime's MatMulNBits.

The lead for issue 27 (docs/edge.md). The kernel and its build/pack code live in
:mod:`services.edge_worker.native` (the edge engine runs it as an onnxruntime custom op with
``int4_kernel=native``); here: :mod:`.reference` (onnxruntime and numpy references) and :mod:`.bench`
(``meshserve bench edge-int4-kernel``).
"""
