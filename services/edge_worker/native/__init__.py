"""Our row-invariant 4- and 8-bit weight kernel (``kq4.c``, AVX2) and the onnxruntime custom op over it (``int4op.c``).

:mod:`.kernel` builds and loads the library and packs MatMulNBits weights; :mod:`.graph` puts the op
into the edge decoder's graph (``int4_kernel=native``, docs/edge.md, issue 27); :mod:`.attention_graph` puts
our attention op (``attn.c``, same library) in place of its GroupQueryAttention nodes; :mod:`.swiglu_graph`
fuses each MLP's gate and up projections and their SwiGLU into one op (``act=1``).
"""
