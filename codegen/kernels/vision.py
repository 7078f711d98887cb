"""DeepSeek-V4.1's vision tower kernels (docs/vision.md): the patches of the pixels, the biases
of the aligner's first projection with its GELU, the 2-D rope on the queries and keys, dense
bidirectional attention over one image's patches, the aligner's r x r merge and the span's rows.
The tower's matmuls, norms, biases, SwiGLU and residual adds are the text model's kernels.

Each kernel's outermost loop runs over independent rows, so GPU targets bind it to threads as
they do the text model's row kernels (``codegen.gpu``); the loops over a thread's small arrays
(a head's accumulator, a block's scores, the rope's angles) are unrolled, so a GPU keeps them in
registers rather than local memory. The attention has a CPU kernel of its own (blocks of
queries sharing each key block, in vectors), which GPU builds do not take. The image's patch grid (rows gh, columns
gw) comes from the buffers' shapes: the entry function views its tensors as grids.
"""

from __future__ import annotations

import math

from tvm.script import tirx as T

from dsv4c.codegen.kernels.codecs import F32, NEG_INF, vector_exp
from dsv4c.codegen.kernels.cpu import ON_STACK, cpu_vector

# Keys a CPU attention task scores together before its running softmax is rescaled (two 16-lane
# vectors per query: 32 ran faster than 16, whose per-block max, exp and sum cost more per key,
# and than 64), and the multiple the rope pads the transposed keys to; a power of two (the
# lanes' max and sum halve the block). A GPU thread takes blocks of 16 (its
# scores in registers).
ATTENTION_KEY_BLOCK = 32
GPU_KEY_BLOCK = 16


def vision_patches(patch: int):
    """pixels viewed as [3, gh, patch, gw, patch] -> [gh * gw, 3 * patch * patch]: patch n = y * gw
    + x in raster order, each patch channel-major (c, row, column), as the release flattens it."""
    width = 3 * patch * patch

    @T.prim_func
    def f(x: T.handle, out: T.handle):
        gh = T.int32()
        gw = T.int32()
        X = T.match_buffer(x, (3, gh, patch, gw, patch), F32)
        OUT = T.match_buffer(out, (gh * gw, width), F32)
        for n in T.parallel(gh * gw):
            for c, py, px in T.grid(3, patch, patch):
                OUT[n, c * patch * patch + py * patch + px] = X[c, n // gw, py, n % gw, px]
    return f


def vision_gelu(dim: int):
    """out = gelu(x + b), the exact (erf) GELU: the aligner's first projection and its activation
    (the tower's other biases are the router's ``add_bias``)."""
    @T.prim_func
    def f(x: T.handle, b: T.handle, out: T.handle):
        n = T.int32()
        X = T.match_buffer(x, (n, dim), F32)
        B = T.match_buffer(b, (dim,), F32)
        OUT = T.match_buffer(out, (n, dim), F32)
        for i in T.parallel(n):
            for j in range(dim):
                OUT[i, j] = (X[i, j] + B[j]) * T.float32(0.5) * (
                    T.float32(1) + T.erf((X[i, j] + B[j]) * T.float32(1 / math.sqrt(2))))
    return f


def vision_rope(heads: int, head_dim: int):
    """The 2-D rope of the queries and keys: qkv viewed as [gh, gw, 3, heads, head_dim] -> the
    rotated queries and the values as qv [2, gh * gw, heads, head_dim], and the rotated keys
    transposed per head, kt [heads, head_dim, padded_keys(gh * gw)] (zeros past the last patch),
    so that the attention scores a block of keys as one vector. Channel i < head_dim / 2 pairs
    with i + head_dim / 2 (the split-half convention); the first half of the pairs turns by the
    patch's row times ``inv[i]``, the second by its column times ``inv[i - head_dim / 4]``."""
    half, quarter, kb = head_dim // 2, head_dim // 4, ATTENTION_KEY_BLOCK

    @T.prim_func
    def f(x: T.handle, inv: T.handle, qv: T.handle, kt: T.handle):
        gh = T.int32()
        gw = T.int32()
        X = T.match_buffer(x, (gh, gw, 3, heads, head_dim), F32)
        INV = T.match_buffer(inv, (quarter,), F32)
        QV = T.match_buffer(qv, (2, gh * gw, heads, head_dim), F32)
        KT = T.match_buffer(kt, (heads, head_dim, (gh * gw + kb - 1) // kb * kb), F32)
        for n in T.parallel(gh * gw):
            trig = T.alloc_buffer((half, 2), F32, scope="local", annotations=ON_STACK)
            for p in T.unroll(half):
                trig[p, 0] = T.cos(T.Cast(F32, T.if_then_else(p < quarter, n // gw, n % gw)) *
                                   INV[T.if_then_else(p < quarter, p, p - quarter)])
                trig[p, 1] = T.sin(T.Cast(F32, T.if_then_else(p < quarter, n // gw, n % gw)) *
                                   INV[T.if_then_else(p < quarter, p, p - quarter)])
            for h in range(heads):
                for p in T.unroll(half):
                    QV[0, n, h, p] = X[n // gw, n % gw, 0, h, p] * trig[p, 0] - \
                        X[n // gw, n % gw, 0, h, p + half] * trig[p, 1]
                    QV[0, n, h, p + half] = X[n // gw, n % gw, 0, h, p + half] * trig[p, 0] + \
                        X[n // gw, n % gw, 0, h, p] * trig[p, 1]
                    KT[h, p, n] = X[n // gw, n % gw, 1, h, p] * trig[p, 0] - \
                        X[n // gw, n % gw, 1, h, p + half] * trig[p, 1]
                    KT[h, p + half, n] = X[n // gw, n % gw, 1, h, p + half] * trig[p, 0] + \
                        X[n // gw, n % gw, 1, h, p] * trig[p, 1]
            for h, j in T.grid(heads, head_dim):
                QV[1, n, h, j] = X[n // gw, n % gw, 2, h, j]
            if n < (gh * gw + kb - 1) // kb * kb - gh * gw:  # the last key block's padding
                for h, j in T.grid(heads, head_dim):
                    KT[h, j, gh * gw + n] = T.float32(0)
    return f


def padded_keys(n):
    """Columns of the rope's transposed keys for n patches: whole ATTENTION_KEY_BLOCKs."""
    return (n + ATTENTION_KEY_BLOCK - 1) // ATTENTION_KEY_BLOCK * ATTENTION_KEY_BLOCK


def vision_attention(heads: int, head_dim: int, *, max_lanes: int = 0, query_block: int = 0):
    """Dense bidirectional attention of one image: every patch attends to every patch, softmax
    scaled by 1 / sqrt(head_dim), no mask, no sink. The rope's qv [2, n, heads, head_dim] and kt
    [heads, head_dim, padded_keys(n)] -> [n, heads * head_dim]. Keys go in blocks (ATTENTION_KEY_BLOCK;
    a GPU thread's GPU_KEY_BLOCK) with a running max per query: its sum and output are rescaled
    once per block, when the block raises the max.

    CPUs: in parallel over (block of queries, head), FlashAttention's loop: each block of keys is
    read once for the task's queries, their scores a vector per query (kt's column block, an FMA
    per channel), the weighted sums a vector chain over the head's channels. GPU builds
    (``max_lanes``, ``codegen.gpu``) take a thread per (query, head) instead, its arrays small
    enough for registers. ``query_block``: a CPU task's queries (0: this CPU's, _query_block)."""
    qb, attend = (1, _per_query_task(heads, head_dim)) if max_lanes else \
        _blocked_task(heads, head_dim, query_block or _query_block())

    @T.prim_func
    def f(qv: T.handle, kt: T.handle, out: T.handle):
        n = T.int32()
        keys = T.int32()
        QV = T.match_buffer(qv, (2, n, heads, head_dim), F32)
        KT = T.match_buffer(kt, (heads, head_dim, keys), F32)
        OUT = T.match_buffer(out, (n, heads * head_dim), F32)
        for job in T.parallel((n + qb - 1) // qb * heads):
            attend(QV, KT, OUT, n, keys, job)
    return f


def _blocked_task(heads: int, head_dim: int, qb: int):
    """(queries per task, the task): vision_attention's CPU task, qb queries of one head."""
    kb, unroll = ATTENTION_KEY_BLOCK, math.gcd(head_dim, 8)
    scale = 1 / math.sqrt(head_dim)

    @T.macro
    def attend(QV, KT, OUT, n, keys, job):
        q = T.alloc_buffer((qb, head_dim), F32, scope="local", annotations=ON_STACK)  # scaled
        acc = T.alloc_buffer((qb, head_dim), F32, scope="local", annotations=ON_STACK)
        score = T.alloc_buffer((qb, kb), F32, scope="local", annotations=ON_STACK)  # then weights
        run = T.alloc_buffer((qb, 3), F32, scope="local", annotations=ON_STACK)  # max, sum, new max
        for i in range(qb):
            for j in T.vectorized(head_dim):
                q[i, j] = QV[0, T.min(job // heads * qb + i, n - 1), job % heads, j] * T.float32(scale)
                acc[i, j] = T.float32(0)
            run[i, 0] = T.float32(NEG_INF)
            run[i, 1] = T.float32(0)
        for blk in range(keys // kb):
            # Every query's scores of the block together: qb vector chains, one kt row read
            # per channel for all of them. The channels go unroll at a time: unrolled whole, LLVM
            # hoisted every broadcast query channel out of the key loop into a 32 KiB stack
            # array that crowded the key and value panels out of L1 (about 20% slower).
            for i in T.unroll(qb):
                for b in T.vectorized(kb):
                    score[i, b] = T.float32(0)
            for j0 in range(head_dim // unroll):
                for j1, i in T.grid(unroll, qb):
                    for b in T.vectorized(kb):
                        score[i, b] = score[i, b] + \
                            q[i, j0 * unroll + j1] * KT[job % heads, j0 * unroll + j1, blk * kb + b]
            for i in range(qb):
                for b in T.vectorized(kb):
                    score[i, b] = T.if_then_else(blk * kb + b < n, score[i, b], T.float32(NEG_INF))
                run[i, 2] = T.max(run[i, 0], _lane_tree(score[i, T.Ramp(0, 1, kb)], kb, T.max))
                if run[i, 2] > run[i, 0]:  # a new max: rescale what was summed so far
                    run[i, 1] = run[i, 1] * vector_exp(run[i, 0] - run[i, 2])
                    for j in T.vectorized(head_dim):
                        acc[i, j] = acc[i, j] * vector_exp(run[i, 0] - run[i, 2])
                    run[i, 0] = run[i, 2]
                for b in T.vectorized(kb):
                    score[i, b] = T.if_then_else(blk * kb + b < n, vector_exp(score[i, b] - run[i, 0]),
                                                 T.float32(0))
                run[i, 1] = run[i, 1] + _lane_tree(score[i, T.Ramp(0, 1, kb)], kb, lambda x, y: x + y)
                # The block's values weighted into the query's output: head_dim / lanes
                # vector chains, each value row read from L1.
                for b in T.unroll(kb):
                    for j in T.vectorized(head_dim):
                        acc[i, j] = acc[i, j] + score[i, b] * QV[1, T.min(blk * kb + b, n - 1), job % heads, j]
        for i in range(qb):
            if job // heads * qb + i < n:
                for j in T.vectorized(head_dim):
                    OUT[job // heads * qb + i, job % heads * head_dim + j] = acc[i, j] / run[i, 1]
    return qb, attend


def _lane_tree(vector, lanes: int, op):
    """op over the lanes of a vector as a tree, halving it at each step: log2(lanes) dependent
    steps where a lane at a time chains lanes of them."""
    while lanes > 1:
        lanes //= 2
        vector = op(T.Shuffle([vector], list(range(lanes))), T.Shuffle([vector], list(range(lanes, 2 * lanes))))
    return vector


def _query_block() -> int:
    """Queries a CPU task scores together: their scores of a key block (ATTENTION_KEY_BLOCK
    lanes each) in half of the vector registers. AVX-512: 8 queries of two registers each (4 ran
    slower, 12 and 14 no faster: ``bench/vision_encode.py --attention``)."""
    lanes, registers = cpu_vector()
    return max(1, registers // 2 * lanes // ATTENTION_KEY_BLOCK)


def _per_query_task(heads: int, head_dim: int):
    """vision_attention's GPU task: one (query, head) a thread, its keys in blocks of
    GPU_KEY_BLOCK (which divides ATTENTION_KEY_BLOCK) whose kb scores are kb independent chains."""
    kb = GPU_KEY_BLOCK
    scale = 1 / math.sqrt(head_dim)

    @T.macro
    def attend(QV, KT, OUT, n, keys, job):
        acc = T.alloc_buffer((head_dim,), F32, scope="local", annotations=ON_STACK)
        score = T.alloc_buffer((kb,), F32, scope="local", annotations=ON_STACK)
        run = T.alloc_buffer((3,), F32, scope="local", annotations=ON_STACK)  # max, sum, block max
        run[0] = T.float32(-3.0e38)
        run[1] = T.float32(0)
        for j in T.unroll(head_dim):
            acc[j] = T.float32(0)
        for blk in range(keys // kb):
            run[2] = run[0]
            for b in T.unroll(kb):
                score[b] = T.float32(0)
            # The block's keys summed side by side: kb independent chains, not one long one.
            for j in T.unroll(head_dim):
                for b in T.unroll(kb):
                    score[b] = score[b] + QV[0, job // heads, job % heads, j] * KT[job % heads, j, blk * kb + b]
            for b in T.unroll(kb):
                score[b] = T.if_then_else(blk * kb + b < n, score[b] * T.float32(scale), T.float32(-3.0e38))
                run[2] = T.max(run[2], score[b])
            run[1] = run[1] * T.exp(run[0] - run[2])
            for j in T.unroll(head_dim):
                acc[j] = acc[j] * T.exp(run[0] - run[2])
            run[0] = run[2]
            for b in T.unroll(kb):
                score[b] = T.if_then_else(blk * kb + b < n, T.exp(score[b] - run[0]), T.float32(0))
                run[1] = run[1] + score[b]
                for j in T.unroll(head_dim):
                    acc[j] = acc[j] + score[b] * QV[1, T.min(blk * kb + b, n - 1), job % heads, j]
        for j in T.unroll(head_dim):
            OUT[job // heads, job % heads * head_dim + j] = acc[j] / run[1]
    return attend


def vision_merge(dim: int, ratio: int):
    """The aligner's r x r merge: features [gh, gw, dim] -> [mh, mw, dim * r * r], token (Y, X)
    holding element c * r * r + dy * r + dx = features[Y * r + dy, X * r + dx, c] (zeros past the
    grid's edge: the release pads the features, not the pixels)."""
    width = dim * ratio * ratio

    @T.prim_func
    def f(x: T.handle, out: T.handle):
        gh = T.int32()
        gw = T.int32()
        mh = T.int32()
        mw = T.int32()
        X = T.match_buffer(x, (gh, gw, dim), F32)
        OUT = T.match_buffer(out, (mh, mw, width), F32)
        for t in T.parallel(mh * mw):
            for c, dy, dx in T.grid(dim, ratio, ratio):
                OUT[t // mw, t % mw, c * ratio * ratio + dy * ratio + dx] = T.if_then_else(
                    t // mw * ratio + dy < gh and t % mw * ratio + dx < gw,
                    X[T.min(t // mw * ratio + dy, gh - 1), T.min(t % mw * ratio + dx, gw - 1), c], T.float32(0))
    return f


def vision_span(dim: int):
    """The span's rows: image_start, each row of tokens [mh, mw, dim] followed by image_newline,
    image_end -> [mh * (mw + 1) + 2, dim]."""
    @T.prim_func
    def f(x: T.handle, start: T.handle, newline: T.handle, end: T.handle, out: T.handle):
        mh = T.int32()
        mw = T.int32()
        X = T.match_buffer(x, (mh, mw, dim), F32)
        START = T.match_buffer(start, (dim,), F32)
        NEWLINE = T.match_buffer(newline, (dim,), F32)
        END = T.match_buffer(end, (dim,), F32)
        OUT = T.match_buffer(out, (mh * (mw + 1) + 2, dim), F32)
        for i in T.parallel(mh * (mw + 1) + 2):
            for j in range(dim):
                OUT[i, j] = T.if_then_else(
                    i == 0, START[j], T.if_then_else(
                        i == mh * (mw + 1) + 1, END[j], T.if_then_else(
                            (i - 1) % (mw + 1) == mw, NEWLINE[j],
                            X[T.min((i - 1) // (mw + 1), mh - 1), T.min((i - 1) % (mw + 1), mw - 1), j])))
    return f
