"""``index_score``: the lightning indexer's scores of a query against its index pool rows."""

from __future__ import annotations

import math

from tvm.script import tirx as T

from dsv4c.artifact.pool_rows import index_plane_row
from dsv4c.codegen.kernels.codecs import F32, NEG_INF
from dsv4c.codegen.kernels.cpu import ON_STACK, cpu_vector
from dsv4c.codegen.kernels.pool_rows import check_index_format, index_key


INDEX_ENTRY_BLOCK = 32  # index entries scored together on the CPU: 4 AVX2 / 2 AVX-512 accumulators


def index_score(heads: int, dim: int, storage: str = "fp32", fp8_format=None, layout=None):
    """I[t, e] = sum_h w[t,h] H^-0.5 relu(<q[t,h], k[rows[t,e]]>) d^-0.5; -inf where rows < 0.
    The key rows are index pool rows in ``storage`` (fp32, or fp8 / fp4 bytes in the pool's
    ``fp8_format`` and ``layout``, decoded value by value exactly as _IndexCodec.read does, see
    index_key).

    In parallel over (query, block of entries): the block's keys are decoded once into an L1
    panel [dim, block], then every head's dot products with the block run as one vector per
    input (the entries are the lanes), several heads at a time, each summed in input order as a
    single dot product would be. GPU targets build ``kernels.gpu_index``'s kernel instead: the
    same sums in the same order over a block of threads, the same bits."""
    scale = (heads ** -0.5) * (dim ** -0.5)
    check_index_format(storage, fp8_format, layout)
    block = INDEX_ENTRY_BLOCK
    # Heads whose dot products run together, their accumulators in half of the vector registers
    # (AVX-512: 8 heads x 2 vectors, AVX2: 2 x 4). One head's 2 or 4 chains of dependent FMAs
    # kept the pipes half idle (bench/RESULTS.md).
    lanes, registers = cpu_vector()
    hi = math.gcd(heads, max(1, registers // 2 // max(1, block // lanes)))

    @T.macro
    def score_block(Q, W, PLANE, ROWS, OUT, keys, part, acc, e, t, first):  # query t's entries first ..
        for j in range(block):  # entries past e or without a row decode row 0; their score is dropped
            for d in range(dim):
                keys[d, j] = index_key(PLANE, T.max(T.if_then_else(first + j < e, ROWS[t, first + j], 0), 0), d,
                                       dim, storage, fp8_format, layout)
        for j in T.vectorized(block):
            acc[j] = T.float32(0)
        for hq in range(heads // hi):
            for hh in T.unroll(hi):
                for j in T.vectorized(block):
                    part[hh, j] = T.float32(0)
            for d in range(dim):
                for hh in T.unroll(hi):
                    for j in T.vectorized(block):
                        part[hh, j] = part[hh, j] + Q[t, hq * hi + hh, d] * keys[d, j]
            for hh in range(hi):  # added in head order
                for j in T.vectorized(block):
                    acc[j] = acc[j] + T.max(part[hh, j], T.float32(0)) * (W[t, hq * hi + hh] * T.float32(scale))
        for j in range(block):
            if first + j < e:
                OUT[t, first + j] = T.if_then_else(ROWS[t, first + j] < 0, T.float32(NEG_INF), acc[j])

    @T.macro
    def score(Q, W, PLANE, ROWS, OUT, n, e):
        for i in T.parallel(n * ((e + block - 1) // block)):  # (query, block of entries)
            keys = T.alloc_buffer((dim, block), F32, scope="local", annotations=ON_STACK)
            part = T.alloc_buffer((hi, block), F32, scope="local", annotations=ON_STACK)
            acc = T.alloc_buffer((block,), F32, scope="local", annotations=ON_STACK)
            score_block(Q, W, PLANE, ROWS, OUT, keys, part, acc, e, i // ((e + block - 1) // block),
                        i % ((e + block - 1) // block) * block)
    return index_score_function(heads, dim, storage, score)


def index_score_function(heads: int, dim: int, storage: str, score):
    """The ``index_score`` kernel (q [N, H, D], w [N, H], the index plane, rows [N, E] -> out
    [N, E]) whose work is the macro ``score(Q, W, PLANE, ROWS, OUT, n, e)``: the CPU's, or the GPU
    targets' (``kernels.gpu_index``)."""
    width, dtype = index_plane_row(dim, storage)

    @T.prim_func
    def f(q: T.handle, w: T.handle, plane: T.handle, rows: T.handle, out: T.handle):
        n = T.int32()
        r = T.int64()  # 64-bit offsets (see kernels.pool_rows, "Pool rows")
        e = T.int32()
        Q = T.match_buffer(q, (n, heads, dim), F32)
        W = T.match_buffer(w, (n, heads), F32)
        PLANE = T.match_buffer(plane, (r, width), dtype)
        ROWS = T.match_buffer(rows, (n, e), "int32")
        OUT = T.match_buffer(out, (n, e), F32)
        score(Q, W, PLANE, ROWS, OUT, n, e)
    return f
