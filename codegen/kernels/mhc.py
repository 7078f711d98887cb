"""Manifold-constrained hyper-connections (mHC): the residual streams' mixing at each seam."""

from __future__ import annotations

import math

from tvm.script import tirx as T

from dsv4c.codegen.kernels.codecs import F32, NEG_INF
from dsv4c.codegen.kernels.cpu import ON_STACK, cpu_vector


def mhc(hc: int, dim: int, iters: int, hc_eps: float, norm_eps: float, with_post: bool, head: bool,
        collapse: bool = True, *, max_lanes: int = 0):
    """One launch per mHC seam. ``with_post`` first forms the streams h' = post * out + comb^T h
    of the finished sub-layer; then (mhc_pre) the next sub-layer's pre / post / Sinkhorn comb
    are computed from rmsnorm(h') @ fn^T and h' is collapsed with pre; ``head`` computes the
    hc_head's pre only. Per token, everything stays in fp32. On the CPU the sums over h' run in
    vector lanes (each lane in input order, the lanes added last); GPU builds (``max_lanes``)
    sum in one lane. Without ``collapse`` (V4.1's ``mhc_mix``, whose ``pre`` collapses the next
    site's input) the first output is pre itself, [n, hc]."""
    flat = hc * dim
    mix = hc if head else (2 + hc) * hc
    n_scale = 1 if head else 3
    # Mixing rows summed together in one pass over h' (independent chains hide the FMA latency):
    # 8 on the CPU; 12 on GPUs, where a thread per token sums in registers. There, passes of 8
    # kept the first two passes' sums (and addresses) live across the third's loop, and nvcc
    # spilled some in the kernel without the collapse at D 5120 and 7168; one pass of all 24
    # rows needs 24 row addresses, which gfx942 / gfx950 keep in scalar registers and spilled
    # in V4-Pro's seam. Each sum's order is the same whatever the grouping.
    rows = math.gcd(mix, 12 if max_lanes else 8)
    lanes = 1 if max_lanes else math.gcd(dim, cpu_vector()[0])
    columns = T.serial if max_lanes else T.vectorized

    @T.macro
    def streams(O, H, POST, COMB, H_OUT, t):
        for k in range(hc):
            for dd in range(dim // lanes):
                for l in columns(lanes):
                    H_OUT[t, k, dd * lanes + l] = POST[t, k] * O[t, dd * lanes + l]
            for j in range(hc):
                for dd in range(dim // lanes):
                    for l in columns(lanes):
                        H_OUT[t, k, dd * lanes + l] = H_OUT[t, k, dd * lanes + l] + \
                            COMB[t, j, k] * H[t, j, dd * lanes + l]

    @T.macro
    def coefficients(SRC, FN, BASE, SCALE, Y, PRE_OUT, POST_OUT, COMB_OUT, t):
        # Loops that index the small local arrays are unrolled: constant indices keep them in
        # registers on GPUs (indexed by a loop variable, gfx942 put them in scratch memory).
        acc = T.alloc_buffer((2,), F32, scope="local", annotations=ON_STACK)
        part = T.alloc_buffer((rows, lanes), F32, scope="local", annotations=ON_STACK)
        m = T.alloc_buffer((mix,), F32, scope="local", annotations=ON_STACK)
        pre = T.alloc_buffer((hc,), F32, scope="local", annotations=ON_STACK)
        c = T.alloc_buffer((hc, hc), F32, scope="local", annotations=ON_STACK)
        for l in columns(lanes):  # the sum of squares (rmsnorm), in part's first row
            part[0, l] = T.float32(0)
        for k in T.unroll(hc):
            for dd in range(dim // lanes):
                for l in columns(lanes):
                    part[0, l] = part[0, l] + SRC[t, k, dd * lanes + l] * SRC[t, k, dd * lanes + l]
        acc[0] = T.float32(0)
        for l in range(lanes):
            acc[0] = acc[0] + part[0, l]
        acc[0] = T.float32(1) / T.sqrt(acc[0] / T.float32(flat) + T.float32(norm_eps))
        for rr in T.unroll(mix // rows):  # rows of fn together: independent sums
            for u in T.unroll(rows):
                for l in columns(lanes):
                    part[u, l] = T.float32(0)
            for k in T.unroll(hc):
                for dd in range(dim // lanes):
                    for u in T.unroll(rows):
                        for l in columns(lanes):
                            part[u, l] = part[u, l] + SRC[t, k, dd * lanes + l] * FN[rr * rows + u, k * dim + dd * lanes + l]
            for u in T.unroll(rows):
                acc[1] = T.float32(0)
                for l in range(lanes):
                    acc[1] = acc[1] + part[u, l]
                m[rr * rows + u] = acc[1] * acc[0]
        for j in T.unroll(hc):
            pre[j] = T.float32(1) / (T.float32(1) + T.exp(-(m[j] * SCALE[0] + BASE[j]))) + T.float32(hc_eps)
            if not collapse:
                Y[t, j] = pre[j]
        if not head:
            for j in T.unroll(hc):
                POST_OUT[t, j] = T.float32(2) / (T.float32(1) + T.exp(-(m[hc + j] * SCALE[1] + BASE[hc + j])))
            for r in T.unroll(hc):  # row softmax + eps
                acc[0] = T.float32(NEG_INF)
                for k in T.unroll(hc):
                    acc[0] = T.max(acc[0], m[2 * hc + r * hc + k] * SCALE[2] + BASE[2 * hc + r * hc + k])
                acc[1] = T.float32(0)
                for k in T.unroll(hc):
                    c[r, k] = T.exp(m[2 * hc + r * hc + k] * SCALE[2] + BASE[2 * hc + r * hc + k] - acc[0])
                    acc[1] = acc[1] + c[r, k]
                for k in T.unroll(hc):
                    c[r, k] = c[r, k] / acc[1] + T.float32(hc_eps)
            for it in range(2 * iters - 1):  # columns first, then rows / columns alternately
                if it % 2 == 0:
                    for k in T.unroll(hc):
                        acc[0] = T.float32(0)
                        for r in T.unroll(hc):
                            acc[0] = acc[0] + c[r, k]
                        for r in T.unroll(hc):
                            c[r, k] = c[r, k] / (acc[0] + T.float32(hc_eps))
                else:
                    for r in T.unroll(hc):
                        acc[0] = T.float32(0)
                        for k in T.unroll(hc):
                            acc[0] = acc[0] + c[r, k]
                        for k in T.unroll(hc):
                            c[r, k] = c[r, k] / (acc[0] + T.float32(hc_eps))
            for r in T.unroll(hc):
                for k in T.unroll(hc):
                    COMB_OUT[t, r, k] = c[r, k]
        if collapse:
            for dd in range(dim // lanes):
                for l in columns(lanes):
                    Y[t, dd * lanes + l] = T.float32(0)
                for j in T.unroll(hc):
                    for l in columns(lanes):
                        Y[t, dd * lanes + l] = Y[t, dd * lanes + l] + pre[j] * SRC[t, j, dd * lanes + l]

    if with_post and not head:
        @T.prim_func
        def f(o: T.handle, h: T.handle, post: T.handle, comb: T.handle, fn: T.handle, base: T.handle,
              scale: T.handle, h_out: T.handle, y: T.handle, post_out: T.handle, comb_out: T.handle):
            n = T.int32()
            O = T.match_buffer(o, (n, dim), F32)
            H = T.match_buffer(h, (n, hc, dim), F32)
            POST = T.match_buffer(post, (n, hc), F32)
            COMB = T.match_buffer(comb, (n, hc, hc), F32)
            FN = T.match_buffer(fn, (mix, flat), F32)
            BASE = T.match_buffer(base, (mix,), F32)
            SCALE = T.match_buffer(scale, (n_scale,), F32)
            H_OUT = T.match_buffer(h_out, (n, hc, dim), F32)
            Y = T.match_buffer(y, (n, dim), F32)
            POST_OUT = T.match_buffer(post_out, (n, hc), F32)
            COMB_OUT = T.match_buffer(comb_out, (n, hc, hc), F32)
            for t in T.parallel(n):
                streams(O, H, POST, COMB, H_OUT, t)
                coefficients(H_OUT, FN, BASE, SCALE, Y, Y, POST_OUT, COMB_OUT, t)
        return f
    if with_post:
        @T.prim_func
        def f(o: T.handle, h: T.handle, post: T.handle, comb: T.handle, fn: T.handle, base: T.handle,
              scale: T.handle, h_out: T.handle, y: T.handle):
            n = T.int32()
            O = T.match_buffer(o, (n, dim), F32)
            H = T.match_buffer(h, (n, hc, dim), F32)
            POST = T.match_buffer(post, (n, hc), F32)
            COMB = T.match_buffer(comb, (n, hc, hc), F32)
            FN = T.match_buffer(fn, (mix, flat), F32)
            BASE = T.match_buffer(base, (mix,), F32)
            SCALE = T.match_buffer(scale, (n_scale,), F32)
            H_OUT = T.match_buffer(h_out, (n, hc, dim), F32)
            Y = T.match_buffer(y, (n, dim), F32)
            for t in T.parallel(n):
                streams(O, H, POST, COMB, H_OUT, t)
                coefficients(H_OUT, FN, BASE, SCALE, Y, Y, Y, Y, t)
        return f
    if not head:
        @T.prim_func
        def f(h: T.handle, fn: T.handle, base: T.handle, scale: T.handle, y: T.handle, post_out: T.handle,
              comb_out: T.handle):
            n = T.int32()
            H = T.match_buffer(h, (n, hc, dim), F32)
            FN = T.match_buffer(fn, (mix, flat), F32)
            BASE = T.match_buffer(base, (mix,), F32)
            SCALE = T.match_buffer(scale, (n_scale,), F32)
            Y = T.match_buffer(y, (n, dim if collapse else hc), F32)
            POST_OUT = T.match_buffer(post_out, (n, hc), F32)
            COMB_OUT = T.match_buffer(comb_out, (n, hc, hc), F32)
            for t in T.parallel(n):
                coefficients(H, FN, BASE, SCALE, Y, Y, POST_OUT, COMB_OUT, t)
        return f

    @T.prim_func
    def f(h: T.handle, fn: T.handle, base: T.handle, scale: T.handle, y: T.handle):
        n = T.int32()
        H = T.match_buffer(h, (n, hc, dim), F32)
        FN = T.match_buffer(fn, (mix, flat), F32)
        BASE = T.match_buffer(base, (mix,), F32)
        SCALE = T.match_buffer(scale, (n_scale,), F32)
        Y = T.match_buffer(y, (n, dim), F32)
        for t in T.parallel(n):
            coefficients(H, FN, BASE, SCALE, Y, Y, Y, Y, t)
    return f


def hc_expand(hc: int, dim: int):
    @T.prim_func
    def f(x: T.handle, out: T.handle):
        n = T.int32()
        X = T.match_buffer(x, (n, dim), F32)
        OUT = T.match_buffer(out, (n, hc, dim), F32)
        for t in T.parallel(n):
            for j in range(hc):
                for d in range(dim):
                    OUT[t, j, d] = X[t, d]
    return f


def mhc_post(hc: int, dim: int):
    """h'[k] = post[k] * out + sum_j comb[j, k] * h[j]."""
    @T.prim_func
    def f(o: T.handle, h: T.handle, post: T.handle, comb: T.handle, out: T.handle):
        n = T.int32()
        O = T.match_buffer(o, (n, dim), F32)
        H = T.match_buffer(h, (n, hc, dim), F32)
        POST = T.match_buffer(post, (n, hc), F32)
        COMB = T.match_buffer(comb, (n, hc, hc), F32)
        OUT = T.match_buffer(out, (n, hc, dim), F32)
        for t in T.parallel(n):
            for k in range(hc):
                for d in range(dim):
                    OUT[t, k, d] = POST[t, k] * O[t, d]
                    for j in range(hc):
                        OUT[t, k, d] = OUT[t, k, d] + COMB[t, j, k] * H[t, j, d]
    return f


def hc_mean(hc: int, dim: int):
    """out[t] = the mean of token t's ``hc`` streams: summed in stream order, then times 1 / hc (as
    the reference interpreter's ``hc_mean``). In parallel over every (token, column): a GPU
    thread each, where a thread per token would read its hc * dim values one after another."""
    @T.prim_func
    def f(h: T.handle, out: T.handle):
        n = T.int32()
        H = T.match_buffer(h, (n, hc, dim), F32)
        OUT = T.match_buffer(out, (n, dim), F32)
        for i in T.parallel(n * dim):
            acc = T.alloc_buffer((1,), F32, scope="local", annotations=ON_STACK)
            acc[0] = H[i // dim, 0, i % dim]
            for j in range(1, hc):
                acc[0] = acc[0] + H[i // dim, j, i % dim]
            OUT[i // dim, i % dim] = acc[0] * T.float32(1.0 / hc)
    return f
