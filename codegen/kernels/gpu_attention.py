"""``sparse_attn`` for GPU targets: a block of threads per (query, group of heads), the query's KV
rows decoded into shared memory a panel at a time and read by every head of the group.

Bound to GPU threads as it is, the CPU kernel gave one thread a head's whole working set (its
output row, the panel): 4 KiB of local memory per thread at V4-Flash's head_dim of 512
(``scripts/kernel_resources.py``). Here, per panel of ROW_BLOCK rows:

1. the block's threads decode the rows into ``panel`` (consecutive threads, consecutive values:
   coalesced reads; zeros where a row is missing, whose weight is 0 and 0 times stale bits
   could be NaN);
2. each (head, row) pair's score is a dot product of the head's query (``qs``, copied to shared
   memory once) with the panel row, split over ``split`` threads (every thread busy);
3. one thread per head: the pair parts added, the online-softmax update of the head's running
   max and denominator, the rescale factor and the block's weights;
4. each thread rescales and accumulates its ``dim / threads`` columns of every head's output in
   registers (consecutive threads, consecutive columns).

Shared rows are padded by ``split`` floats so the threads of one dot product, and the rows a
warp reads at once, fall in different banks. The CPU builds the same phases (``emulate``, ``gpu_block``),
so tests compare it with the CPU kernel. The sums run in another order
than the CPU kernel's: equal within rounding, not bit for bit.
"""

from __future__ import annotations

import math

import tvm
from tvm import tirx
from tvm.script import tirx as T

from dsv4c.codegen.kernels.attention import sparse_attn_function
from dsv4c.codegen.kernels.codecs import F32, NEG_INF
from dsv4c.codegen.kernels.gpu_block import block_phases
from dsv4c.codegen.kernels.pool_rows import check_main_fp8, main_fp8_value

THREADS = 128  # at most; fewer when the head dim has fewer factors of two
HEAD_GROUP = 8  # heads sharing each panel (at most): 16 KiB of queries at head_dim 512
ROW_BLOCK = 8  # rows a panel holds: 16 KiB at head_dim 512


def sparse_attn_blocked(heads: int, dim: int, scale: float, main_storage: str = "fp32", rope_dim: int = 0,
                        fp8_format=None, emulate: bool = False):
    """``attention.sparse_attn``'s outputs with the same arguments, in blocks (module docstring)."""
    nope_dim = dim - rope_dim
    if main_storage == "fp8":
        check_main_fp8(nope_dim, fp8_format)
    elif main_storage != "fp32":
        raise ValueError(f"sparse_attn reads fp32 or fp8 main pools, not {main_storage!r}")
    threads = math.gcd(dim, THREADS)
    group = math.gcd(heads, HEAD_GROUP)
    rb = ROW_BLOCK
    pairs = group * rb  # (head, row) dot products a panel takes
    split = max(1, threads // pairs)  # threads per dot product
    stride = dim + split  # shared row pitch (module docstring)
    per = dim // threads  # output columns a thread accumulates, per head
    assert group <= threads, (heads, dim)  # thread h runs head h's softmax
    block_loop, thread_loop, barrier, scope, registers, own = block_phases(emulate)

    def row_at(ROWS, m, t, k):
        """Entry k of query t's row list, -1 (no row) past its end m."""
        return T.if_then_else(k < m, ROWS[t, k], -1)

    def stored(pool, row, d):
        if main_storage == "fp32":
            return pool[0][row, d]
        return main_fp8_value(pool[0], pool[1], row, d, 0, nope_dim, fp8_format)

    @T.macro
    def fill(pool, STEP, ROWS, panel, r, m, t, kb, tx):  # phase 1
        for j in range(rb):
            for i in T.unroll(per):
                if row_at(ROWS, m, t, kb * rb + j) < 0:
                    panel[j * stride + i * threads + tx] = T.float32(0)
                elif ROWS[t, kb * rb + j] >= r:  # this step's fresh KV
                    panel[j * stride + i * threads + tx] = STEP[ROWS[t, kb * rb + j] - r, i * threads + tx]
                else:
                    panel[j * stride + i * threads + tx] = stored(pool, ROWS[t, kb * rb + j], i * threads + tx)

    @T.macro
    def dot(qs, panel, part, tx):  # phase 2: part[pair, p] = thread p's share of the pair's dot product
        acc = T.alloc_buffer((1,), F32, scope="local")
        for q in range(tx // split, pairs, threads // split):
            acc[0] = T.float32(0)
            for k in range(dim // split):
                acc[0] = acc[0] + qs[q // rb * stride + k * split + tx % split] * \
                    panel[q % rb * stride + k * split + tx % split]
            part[q * split + tx % split] = acc[0]

    @T.macro
    def softmax(ROWS, part, weight, top, denom, factor, m, t, kb, tx):  # phase 3, thread h: head h's
        # Through registers, each shared value read and written at one index per thread: TVM would
        # place a barrier between a shared write and a read of another index here, inside this
        # phase's condition, which it cannot.
        w = T.alloc_buffer((rb,), F32, scope="local")  # the block's scores, then weights
        v = T.alloc_buffer((3,), F32, scope="local")  # a score, the new max, the denominator
        if tx < group:
            v[1] = top[tx]
            for j in T.unroll(rb):
                w[j] = T.float32(NEG_INF)
                if row_at(ROWS, m, t, kb * rb + j) >= 0:
                    v[0] = T.float32(0)
                    for p in range(split):
                        v[0] = v[0] + part[(tx * rb + j) * split + p]
                    w[j] = v[0] * T.float32(scale)
                    v[1] = T.max(v[1], w[j])
            factor[tx] = T.exp(top[tx] - v[1])  # 1 unless the max grew
            top[tx] = v[1]
            v[2] = denom[tx] * factor[tx]
            for j in T.unroll(rb):
                w[j] = T.if_then_else(w[j] == T.float32(NEG_INF), T.float32(0), T.exp(w[j] - v[1]))
                v[2] = v[2] + w[j]
                weight[tx * rb + j] = w[j]
            denom[tx] = v[2]

    @T.macro
    def accumulate(panel, weight, factor, o, tx):  # phase 4: this thread's columns of every head
        for h in T.unroll(group):
            for i in T.unroll(per):
                o[tx * own, h * per + i] = o[tx * own, h * per + i] * factor[h]
                for j in T.unroll(rb):
                    o[tx * own, h * per + i] = o[tx * own, h * per + i] + \
                        weight[h * rb + j] * panel[j * stride + i * threads + tx]

    @T.macro
    def attend(Q, pool, STEP, SINK, ROWS, OUT, r, m, n):
        for b in block_loop(n * (heads // group)):  # (query, group of heads)
            qs = T.alloc_buffer((group * stride,), F32, scope=scope)
            panel = T.alloc_buffer((rb * stride,), F32, scope=scope)
            part = T.alloc_buffer((pairs * split,), F32, scope=scope)
            weight = T.alloc_buffer((pairs,), F32, scope=scope)  # scores, then weights
            top = T.alloc_buffer((group,), F32, scope=scope)  # per head: the running max,
            denom = T.alloc_buffer((group,), F32, scope=scope)  # the denominator,
            factor = T.alloc_buffer((group,), F32, scope=scope)  # and this block's rescale factor
            o = T.alloc_buffer((threads if emulate else 1, group * per), F32, scope=registers)
            for tx in thread_loop(threads):
                for h in range(group):
                    for i in T.unroll(per):
                        qs[h * stride + i * threads + tx] = Q[b // (heads // group), b % (heads // group) * group + h,
                                                              i * threads + tx]
                        o[tx * own, h * per + i] = T.float32(0)
                if tx < group:
                    top[tx] = SINK[b % (heads // group) * group + tx]  # the sink takes part in the max
                    denom[tx] = T.float32(1)  # and in the denominator: exp(sink - max)
            for kb in range((m + rb - 1) // rb):
                barrier()
                for tx in thread_loop(threads):
                    fill(pool, STEP, ROWS, panel, r, m, b // (heads // group), kb, tx)
                barrier()
                for tx in thread_loop(threads):
                    dot(qs, panel, part, tx)
                barrier()
                for tx in thread_loop(threads):
                    softmax(ROWS, part, weight, top, denom, factor, m, b // (heads // group), kb, tx)
                barrier()
                for tx in thread_loop(threads):
                    accumulate(panel, weight, factor, o, tx)
            barrier()
            for tx in thread_loop(threads):
                for h in T.unroll(group):
                    for i in T.unroll(per):
                        OUT[b // (heads // group), b % (heads // group) * group + h, i * threads + tx] = \
                            o[tx * own, h * per + i] / denom[h]

    return sparse_attn_function(heads, dim, main_storage, rope_dim, attend)


def sparse_attn_kernel(spec, target: tvm.target.Target) -> tirx.PrimFunc:
    """The blocked ``sparse_attn`` for a GPU ``target`` (``codegen.gpu.SCHEDULE_RULES``). The CPU
    kernel's head blocking (decode's and prefill's) is the CPU's: both map to this one."""
    p = spec.params
    return sparse_attn_blocked(p.heads, p.dim, p.scale, p.main_storage, p.rope_dim, p.fp8_format)
