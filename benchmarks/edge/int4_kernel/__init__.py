"""A row-invariant int4 x int8 matmul kernel of our own (AVX2), benchmarked against onnxruntime's MatMulNBits.

The lead for issue 27 (docs/edge.md): ``kq4.c`` (the kernel), :mod:`.kernel` (build, load, pack,
run), :mod:`.reference` (onnxruntime and numpy references), :mod:`.bench`
(``meshserve bench edge-int4-kernel``). Not used by the engine yet.
"""
