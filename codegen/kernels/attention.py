"""``sparse_attn``: softmax attention over each query's list of KV pool rows."""

from __future__ import annotations

import math

from tvm.script import tirx as T

from dsv4c.artifact.pool_rows import main_nope_width
from dsv4c.codegen.kernels.codecs import F32, NEG_INF, vector_exp
from dsv4c.codegen.kernels.cpu import ON_STACK, cpu_vector
from dsv4c.codegen.kernels.pool_rows import check_main_fp8, main_fp8_value


# Heads that share each KV row read on the CPU (MQA: every head reads the same rows): a task's
# heads. Decode steps take 8, so that one query's heads make tasks for every core; prefill takes
# 64, whose panel copies (the rows gathered from L3 for each block of heads) cost less: faster
# than 8 or 32 (bench/RESULTS.md).
ATTN_HEAD_BLOCK = 8
ATTN_PREFILL_HEAD_BLOCK = 64
ATTN_ROW_BLOCK = 8  # KV rows decoded together into an L1 panel, one online-softmax update each


def sparse_attn(heads: int, dim: int, scale: float, main_storage: str = "fp32", rope_dim: int = 0,
                fp8_format=None, head_block: int = ATTN_HEAD_BLOCK, heads_at_once: int = 0):
    """Softmax attention over each query's row list (``rows [N, M]``, -1 = none, see
    ``step_kernels.attention_rows``); rows >= R are this step's fresh KV.
    The per-head sink enters the denominator only.

    In parallel over (query, block of ``head_block`` heads); the query's rows go in blocks of
    ATTN_ROW_BLOCK, each decoded once into an L1 panel that every head of the block reads twice:
    for its scores (vector dot products along the head dim) and, after an online-softmax update
    of the running max, denominator and output (rescaled when the max grows), for its weighted
    sum; ``heads_at_once`` heads (0: two) share each of those reads, which changes no bits. GPU
    targets build ``kernels.gpu_attention``'s kernel instead.

    ``main_storage`` is the pool's: fp32 takes one plane ``pool [R, dim]``; fp8 takes the two
    planes of that layout, ``nope_plane`` and ``rope_plane`` (the last ``rope_dim`` values are the
    rope part, the NoPE codes in the pool's ``fp8_format``), decoded value by value as
    _MainCodec.read does (see main_fp8_value). So the arguments are (q, pool, step, sink, rows,
    out) or (q, nope_plane, rope_plane, step, sink, rows, out)."""
    nope_dim = dim - rope_dim
    # A vector chunk never straddles the NoPE / rope boundary (nor, lanes dividing 64, a scale group).
    lanes = next(l for l in (16, 8, 4, 2, 1) if dim % l == 0 and nope_dim % l == 0 and l <= cpu_vector()[0])
    chunks = dim // lanes
    hb, rb = math.gcd(heads, head_block), ATTN_ROW_BLOCK
    # Heads whose scores and weighted sums accumulate together, each panel vector loaded once
    # for all of them (two on any CPU), and the accumulator vectors a head keeps in registers:
    # half of the registers between the heads, at most 8. AVX-512: 2 x 8 of 32. AVX2: 2 x 4 of 16,
    # so a head's scores take the block's rows 4 at a time and its weighted sums strips of 4
    # vectors. One head with 8 (9 vector loads per 8 FMAs where two heads with 4 load 6) ran
    # slower (bench/RESULTS.md).
    hp = math.gcd(hb, heads_at_once or 2)
    per_head = max(1, min(8, cpu_vector()[1] // 2 // hp))
    strip = math.gcd(dim, per_head * lanes)  # the weighted sums' strip of the head dim
    rh = math.gcd(rb, per_head)  # rows a score pass takes
    if main_storage == "fp8":
        check_main_fp8(nope_dim, fp8_format)
    elif main_storage != "fp32":
        raise ValueError(f"sparse_attn reads fp32 or fp8 main pools, not {main_storage!r}")

    def row_at(ROWS, m, t, k):
        """Entry k of query t's row list, -1 (no row) past its end m."""
        return T.if_then_else(k < m, ROWS[t, k], -1)

    def stored(pool, row, c, l):
        """Value c * lanes + l of pool row ``row`` (decoded)."""
        if main_storage == "fp32":
            return pool[0][row, c * lanes + l]
        return main_fp8_value(pool[0], pool[1], row, c * lanes, l, nope_dim, fp8_format)

    def lane_total(part, hh, j):
        """The lanes of part[hh, j] added as a tree, halving the vector at each step: log2(lanes)
        shuffles and adds where a lane at a time took a scalar extract and add per lane."""
        if lanes == 1:
            return part[hh, j, 0]
        total, width = part[hh, j, T.Ramp(0, 1, lanes)], lanes
        while width > 1:
            width //= 2
            total = T.Shuffle([total], list(range(width))) + T.Shuffle([total], list(range(width, 2 * width)))
        return total

    @T.macro
    def online_softmax(ROWS, o, score, state, part, m, t, kb, h, hh):
        # Head h's scores of the block (from its accumulators part[hh]), its running max, the
        # denominator and output rescaled to it; then the block's weights in score[h].
        state[h, 2] = state[h, 0]
        for j in range(rb):
            score[h, j] = T.float32(NEG_INF)
            if row_at(ROWS, m, t, kb * rb + j) >= 0:
                score[h, j] = lane_total(part, hh, j) * T.float32(scale)
                state[h, 2] = T.max(state[h, 2], score[h, j])
        if state[h, 2] > state[h, 0]:  # a new max: rescale what was summed so far
            state[h, 3] = T.exp(state[h, 0] - state[h, 2])
            state[h, 1] = state[h, 1] * state[h, 3]
            for d in T.vectorized(dim):
                o[h, d] = o[h, d] * state[h, 3]
            state[h, 0] = state[h, 2]
        for j in T.vectorized(rb):
            score[h, j] = T.if_then_else(score[h, j] == T.float32(NEG_INF), T.float32(0),
                                         vector_exp(score[h, j] - state[h, 0]))
        for j in range(rb):
            state[h, 1] = state[h, 1] + score[h, j]

    # r: the pool's rows as int32, like the row ids it is compared with (only offsets need 64 bits).
    @T.macro
    def attend(Q, pool, STEP, SINK, ROWS, OUT, r, m, t, h0):
        panel = T.alloc_buffer((rb, dim), F32, scope="local", annotations=ON_STACK)  # the block's KV rows
        o = T.alloc_buffer((hb, dim), F32, scope="local", annotations=ON_STACK)  # running weighted sums
        score = T.alloc_buffer((hb, rb), F32, scope="local", annotations=ON_STACK)  # scaled, then weights
        state = T.alloc_buffer((hb, 4), F32, scope="local", annotations=ON_STACK)  # max, denominator, new max, factor
        part = T.alloc_buffer((hp, rb, lanes), F32, scope="local", annotations=ON_STACK)
        acc = T.alloc_buffer((hp, strip), F32, scope="local", annotations=ON_STACK)
        live = T.alloc_buffer((1,), "int32", scope="local", annotations=ON_STACK)  # the block has a row
        for h in range(hb):
            state[h, 0] = SINK[h0 + h]  # the sink takes part in the max (for stability)
            state[h, 1] = T.float32(1)  # and in the denominator: exp(sink - max)
            for d in T.vectorized(dim):
                o[h, d] = T.float32(0)
        for kb in range((m + rb - 1) // rb):
            # A block without rows changes nothing (its weights are 0): skipped. Row lists hold
            # whole blocks of them, a CSA query's top-k slots past the entries it can see above all.
            live[0] = 0
            for j in range(rb):
                live[0] = live[0] | T.Cast("int32", row_at(ROWS, m, t, kb * rb + j) >= 0)
            if live[0] != 0:
                for j in range(rb):
                    # Zeros where there is no row: its weight is 0, and 0 times stale bits could be NaN.
                    if row_at(ROWS, m, t, kb * rb + j) < 0:
                        for d in T.vectorized(dim):
                            panel[j, d] = T.float32(0)
                    elif ROWS[t, kb * rb + j] >= r:  # this step's fresh KV
                        for d in T.vectorized(dim):
                            panel[j, d] = STEP[ROWS[t, kb * rb + j] - r, d]
                    else:
                        for c in range(chunks):
                            for l in T.vectorized(lanes):
                                panel[j, c * lanes + l] = stored(pool, ROWS[t, kb * rb + j], c, l)
                for hq in range(hb // hp):
                    # The heads' scores against the block's rows, a vector accumulator per head and
                    # row, rh rows a pass.
                    for jp in T.unroll(rb // rh):
                        for hh in T.unroll(hp):
                            for j in T.unroll(rh):
                                for l in T.vectorized(lanes):
                                    part[hh, jp * rh + j, l] = T.float32(0)
                        for c in range(chunks):
                            for j in T.unroll(rh):
                                for hh in T.unroll(hp):
                                    for l in T.vectorized(lanes):
                                        part[hh, jp * rh + j, l] = part[hh, jp * rh + j, l] + \
                                            Q[t, h0 + hq * hp + hh, c * lanes + l] * panel[jp * rh + j, c * lanes + l]
                    for hh in range(hp):
                        online_softmax(ROWS, o, score, state, part, m, t, kb, hq * hp + hh, hh)
                    # The weighted sums, in strips of the head dim that stay in registers over the rows.
                    for cs in range(dim // strip):
                        for hh in T.unroll(hp):
                            for u in T.vectorized(strip):
                                acc[hh, u] = o[hq * hp + hh, cs * strip + u]
                        for j in T.unroll(rb):
                            for hh in T.unroll(hp):
                                for u in T.vectorized(strip):
                                    acc[hh, u] = acc[hh, u] + score[hq * hp + hh, j] * panel[j, cs * strip + u]
                        for hh in T.unroll(hp):
                            for u in T.vectorized(strip):
                                o[hq * hp + hh, cs * strip + u] = acc[hh, u]
        for h in range(hb):
            for d in T.vectorized(dim):
                OUT[t, h0 + h, d] = o[h, d] / state[h, 1]

    @T.macro
    def blocks(Q, pool, STEP, SINK, ROWS, OUT, r, m, n):
        for i in T.parallel(n * (heads // hb)):  # (query, block of heads)
            attend(Q, pool, STEP, SINK, ROWS, OUT, r, m, i // (heads // hb), i % (heads // hb) * hb)
    return sparse_attn_function(heads, dim, main_storage, rope_dim, blocks)


def sparse_attn_function(heads: int, dim: int, main_storage: str, rope_dim: int, attend):
    """The ``sparse_attn`` kernel, arguments (q, pool, step, sink, rows, out) or, for an fp8 main
    pool, (q, nope_plane, rope_plane, step, sink, rows, out), whose work is the macro
    ``attend(Q, pool, STEP, SINK, ROWS, OUT, r, m, n)`` (``pool``: the planes' buffers, ``r``:
    their row count as int32): the CPU's, or the GPU targets' (``kernels.gpu_attention``)."""
    nope_dim = dim - rope_dim
    if main_storage == "fp8":
        @T.prim_func
        def f(q: T.handle, nope_plane: T.handle, rope_plane: T.handle, step: T.handle, sink: T.handle,
              rows: T.handle, out: T.handle):
            n = T.int32()
            r = T.int64()  # 64-bit offsets (see kernels.pool_rows, "Pool rows")
            s = T.int32()
            m = T.int32()
            Q = T.match_buffer(q, (n, heads, dim), F32)
            NOPE = T.match_buffer(nope_plane, (r, main_nope_width(nope_dim)), "uint8")
            ROPE = T.match_buffer(rope_plane, (r, rope_dim), "uint16")
            STEP = T.match_buffer(step, (s, dim), F32)
            SINK = T.match_buffer(sink, (heads,), F32)
            ROWS = T.match_buffer(rows, (n, m), "int32")
            OUT = T.match_buffer(out, (n, heads, dim), F32)
            attend(Q, (NOPE, ROPE), STEP, SINK, ROWS, OUT, T.Cast("int32", r), m, n)
        return f

    @T.prim_func
    def f(q: T.handle, pool: T.handle, step: T.handle, sink: T.handle, rows: T.handle, out: T.handle):
        n = T.int32()
        r = T.int64()  # 64-bit offsets (see kernels.pool_rows, "Pool rows")
        s = T.int32()
        m = T.int32()
        Q = T.match_buffer(q, (n, heads, dim), F32)
        POOL = T.match_buffer(pool, (r, dim), F32)
        STEP = T.match_buffer(step, (s, dim), F32)
        SINK = T.match_buffer(sink, (heads,), F32)
        ROWS = T.match_buffer(rows, (n, m), "int32")
        OUT = T.match_buffer(out, (n, heads, dim), F32)
        attend(Q, (POOL,), STEP, SINK, ROWS, OUT, T.Cast("int32", r), m, n)
    return f
