"""``index_score`` for GPU targets: a block of THREADS threads per (query, block of ENTRY_BLOCK
entries), the block's keys decoded once into shared memory.

Per block:

1. the threads decode the entries' key rows into ``panel`` (consecutive threads, consecutive
   values of a row: coalesced reads);
2. each (head, entry) pair's dot product with the panel row, a thread per pair in turn (a
   warp's threads: one head, consecutive entries, so the query value they read is one
   broadcast and the panel rows, padded by one float, fall in different banks), in ``terms``;
3. a thread per entry adds its terms' ReLU times the head's weight in head order.

The dot products run in input order and the terms are added in head order, as the CPU's panel
kernel does: the same bits (``tests/test_cpu_kernels.py``). One thread per entry decoding each
key value as it read it (the kernel before this one) decoded every key once per head. The CPU
builds the same phases (``emulate``, ``gpu_block``).
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

from dsv4c.codegen.kernels.codecs import F32, NEG_INF
from dsv4c.codegen.kernels.gpu_block import block_phases
from dsv4c.codegen.kernels.index import index_score_function
from dsv4c.codegen.kernels.pool_rows import check_index_format, index_key

THREADS = 128
ENTRY_BLOCK = 32  # a warp's entries: 16.5 KiB of panel at Flash's index_head_dim of 128


def index_score_blocked(heads: int, dim: int, storage: str = "fp32", fp8_format=None, layout=None,
                        emulate: bool = False):
    """``index.index_score``'s outputs with the same arguments, in blocks (module docstring)."""
    scale = (heads ** -0.5) * (dim ** -0.5)
    check_index_format(storage, fp8_format, layout)
    eb, stride = ENTRY_BLOCK, dim + 1
    block_loop, thread_loop, barrier, scope, _, _ = block_phases(emulate)

    def query(b, e):  # block b's query
        return b // ((e + eb - 1) // eb)

    def first(b, e):  # block b's first entry
        return b % ((e + eb - 1) // eb) * eb

    @T.macro
    def score(Q, W, PLANE, ROWS, OUT, n, e):
        for b in block_loop(n * ((e + eb - 1) // eb)):  # (query, block of entries)
            panel = T.alloc_buffer((eb * stride,), F32, scope=scope)
            terms = T.alloc_buffer((heads * eb,), F32, scope=scope)
            part = T.alloc_buffer((1,), F32, scope="local")
            for tx in thread_loop(THREADS):
                # Entries past e or without a row decode row 0; their score is dropped.
                for j in range(eb):
                    for d in range(tx, dim, THREADS):
                        row = T.if_then_else(first(b, e) + j < e, ROWS[query(b, e), first(b, e) + j], 0)
                        panel[j * stride + d] = index_key(PLANE, T.max(row, 0), d, dim, storage, fp8_format, layout)
            barrier()
            for tx in thread_loop(THREADS):
                for p in range(tx, heads * eb, THREADS):  # (head p // eb, entry p % eb)
                    part[0] = T.float32(0)
                    for d in range(dim):
                        part[0] = part[0] + Q[query(b, e), p // eb, d] * panel[p % eb * stride + d]
                    terms[p] = part[0]
            barrier()
            for tx in thread_loop(THREADS):
                if tx < eb and first(b, e) + tx < e:
                    part[0] = T.float32(0)
                    for h in range(heads):  # added in head order
                        part[0] = part[0] + T.max(terms[h * eb + tx], T.float32(0)) * \
                            (W[query(b, e), h] * T.float32(scale))
                    OUT[query(b, e), first(b, e) + tx] = T.if_then_else(
                        ROWS[query(b, e), first(b, e) + tx] < 0, T.float32(NEG_INF), part[0])
    return index_score_function(heads, dim, storage, score)


def index_score_kernel(spec, target: tvm.target.Target) -> tirx.PrimFunc:
    """The blocked ``index_score`` for a GPU ``target`` (``codegen.gpu.SCHEDULE_RULES``)."""
    return index_score_blocked(**spec.params._asdict())
