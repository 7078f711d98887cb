"""Data-movement kernels: the row gathers and column copies the runtime needs between compute
kernels. On the CPU these could be numpy slicing, but on a GPU the activations never leave the
device, so every executor-side rearrangement is a kernel too, and the CPU runs the same ones
(one executor for every target). All sizes are symbolic: one instance serves every shape.
"""

from __future__ import annotations

from tvm.script import tirx as T

F32 = "float32"


def gather_rows():
    """out[i] = x[idx[i]], or zeros where idx[i] < 0 (the padding rows of a GEMM block)."""
    @T.prim_func
    def f(x: T.handle, idx: T.handle, out: T.handle):
        n = T.int32()
        m = T.int32()
        d = T.int32()
        X = T.match_buffer(x, (n, d), F32)
        IDX = T.match_buffer(idx, (m,), "int32")
        OUT = T.match_buffer(out, (m, d), F32)
        for i in T.parallel(m):
            for j in range(d):
                OUT[i, j] = T.if_then_else(IDX[i] >= 0, X[T.max(IDX[i], 0), j], T.float32(0))
    return f


def copy_columns():
    """dst[:, dst_col + j] = src[:, src_col + j] for j < width: splits merged projections and
    moves one head group in or out of a [tokens, groups * rank] activation."""
    @T.prim_func
    def f(src: T.handle, src_col: T.int32, dst: T.handle, dst_col: T.int32, width: T.int32):
        n = T.int32()
        s = T.int32()
        d = T.int32()
        SRC = T.match_buffer(src, (n, s), F32)
        DST = T.match_buffer(dst, (n, d), F32)
        for i in T.parallel(n):
            for j in range(width):
                DST[i, dst_col + j] = SRC[i, src_col + j]
    return f
