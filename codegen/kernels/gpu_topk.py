"""``topk_rows`` for GPU targets: a block of THREADS threads per row, with ``topk.topk_rows``'s
algorithm (the same ids, bit for bit) spread over the block's threads.

Bound to GPU threads as it is, the CPU kernel gave one thread a row and its kept keys and
columns: 4 KiB of local memory per thread for V4-Flash's top-512 (``scripts/kernel_resources.py``).
Here:

1. the binary search for the k-th largest order key: each thread counts the keys above the
   candidate in every THREADS-th column from its own (a warp reads consecutive columns), every
   thread adds the block's counts (the same total everywhere, so every thread takes the same
   branch of the search, in its own registers);
2. the columns kept: each thread counts the keys above the threshold and equal to it in its
   contiguous chunk of the columns, one thread scans the counts, each thread writes its chunk's
   kept (key, column) pairs to shared memory at their place in column order (the first
   ``ties`` equal ones in the row kept);
3. each kept column's rank among the kept (a larger key, or an equal one to its left), kept
   columns split over the threads.

The CPU builds the same phases (``emulate``, ``gpu_block``), so tests compare it with the CPU
kernel.
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

from dsv4c.codegen.kernels.gpu_block import block_phases
from dsv4c.codegen.kernels.topk import INT32_MIN, order_key, topk_rows_function

THREADS = 256


def topk_rows_blocked(k: int, emulate: bool = False):
    """``topk.topk_rows(k)``'s outputs, in blocks (module docstring)."""
    block_loop, thread_loop, barrier, scope, registers, own = block_phases(emulate)

    def chunk(c, tx):  # thread tx's columns
        return T.serial(tx * ((c + THREADS - 1) // THREADS), T.min(c, (tx + 1) * ((c + THREADS - 1) // THREADS)))

    @T.macro
    def count_above(X, t, c, tx, threshold, counts, run):  # counts[tx]: keys > threshold among tx's
        run[tx * own, 0] = 0
        for col in range(tx, c, THREADS):  # strided: a warp reads consecutive columns
            run[tx * own, 0] = run[tx * own, 0] + T.Select(order_key(X[t, col]) > threshold, 1, 0)
        counts[tx] = run[tx * own, 0]

    @T.macro
    def block_total(counts, run, tx):  # the block's counts added (by every thread)
        run[tx * own, 0] = 0
        for u in range(THREADS):
            run[tx * own, 0] = run[tx * own, 0] + counts[u]

    @T.macro
    def select(X, IDS, n, c):
        for t in block_loop(n):
            counts = T.alloc_buffer((THREADS,), "int32", scope=scope)  # above the candidate / threshold
            equal = T.alloc_buffer((THREADS,), "int32", scope=scope)  # equal to the threshold
            starts = T.alloc_buffer((THREADS + 1, 2), "int32", scope=scope)  # above, equal before a chunk
            kept_key = T.alloc_buffer((k,), "int32", scope=scope)
            kept_col = T.alloc_buffer((k,), "int32", scope=scope)
            # Per thread: the search's [lo, hi] (the largest key below the k-th largest, with at
            # least k keys above lo) and the midpoint; identical in every thread.
            search = T.alloc_buffer((THREADS if emulate else 1, 3), "int64", scope=registers)
            run = T.alloc_buffer((THREADS if emulate else 1, 3), "int32", scope=registers)
            for tx in thread_loop(THREADS):
                search[tx * own, 0] = T.int64(INT32_MIN)
                search[tx * own, 1] = T.int64(-INT32_MIN - 2)
            for _ in range(32):
                barrier()
                for tx in thread_loop(THREADS):
                    search[tx * own, 2] = search[tx * own, 0] + (search[tx * own, 1] - search[tx * own, 0] + 1) // 2
                    count_above(X, t, c, tx, T.Cast("int32", search[tx * own, 2]), counts, run)
                barrier()
                for tx in thread_loop(THREADS):
                    block_total(counts, run, tx)
                    if search[tx * own, 0] < search[tx * own, 1]:
                        if run[tx * own, 0] >= k:
                            search[tx * own, 0] = search[tx * own, 2]
                        else:
                            search[tx * own, 1] = search[tx * own, 2] - 1
            # Keep the keys above the k-th largest, and as many equal to it as fit, in column order.
            barrier()
            for tx in thread_loop(THREADS):
                run[tx * own, 0] = 0
                run[tx * own, 1] = 0
                for col in chunk(c, tx):
                    run[tx * own, 0] = run[tx * own, 0] + T.Select(
                        order_key(X[t, col]) > T.Cast("int32", search[tx * own, 0] + 1), 1, 0)
                    run[tx * own, 1] = run[tx * own, 1] + T.Select(
                        order_key(X[t, col]) == T.Cast("int32", search[tx * own, 0] + 1), 1, 0)
                counts[tx] = run[tx * own, 0]
                equal[tx] = run[tx * own, 1]
            barrier()
            for tx in thread_loop(THREADS):
                if tx == 0:
                    run[0, 0] = 0
                    run[0, 1] = 0
                    for u in range(THREADS):
                        starts[u, 0] = run[0, 0]
                        starts[u, 1] = run[0, 1]
                        run[0, 0] = run[0, 0] + counts[u]
                        run[0, 1] = run[0, 1] + equal[u]
                    starts[THREADS, 0] = run[0, 0]
                    starts[THREADS, 1] = run[0, 1]
            barrier()
            for tx in thread_loop(THREADS):
                # run: above and equal before the next column; the first k - above ties are kept
                run[tx * own, 0] = starts[tx, 0]
                run[tx * own, 1] = starts[tx, 1]
                run[tx * own, 2] = k - starts[THREADS, 0]
                for col in chunk(c, tx):
                    if order_key(X[t, col]) > T.Cast("int32", search[tx * own, 0] + 1) or (
                            order_key(X[t, col]) == T.Cast("int32", search[tx * own, 0] + 1)
                            and run[tx * own, 1] < run[tx * own, 2]):
                        kept_key[run[tx * own, 0] + T.min(run[tx * own, 1], run[tx * own, 2])] = order_key(X[t, col])
                        kept_col[run[tx * own, 0] + T.min(run[tx * own, 1], run[tx * own, 2])] = col
                    if order_key(X[t, col]) > T.Cast("int32", search[tx * own, 0] + 1):
                        run[tx * own, 0] = run[tx * own, 0] + 1
                    elif order_key(X[t, col]) == T.Cast("int32", search[tx * own, 0] + 1):
                        run[tx * own, 1] = run[tx * own, 1] + 1
            barrier()
            # A kept column's place: the kept columns with a larger key, or an equal one to its left.
            for tx in thread_loop(THREADS):
                run[tx * own, 2] = starts[THREADS, 0] + T.min(starts[THREADS, 1], k - starts[THREADS, 0])  # kept
                for i in range(tx, run[tx * own, 2], THREADS):
                    run[tx * own, 0] = 0
                    for j in range(run[tx * own, 2]):
                        run[tx * own, 0] = run[tx * own, 0] + T.Select(T.Or(
                            kept_key[j] > kept_key[i], T.And(kept_key[j] == kept_key[i], j < i)), 1, 0)
                    IDS[t, run[tx * own, 0]] = kept_col[i]
                for j in range(run[tx * own, 2] + tx, k, THREADS):
                    IDS[t, j] = -1
    return topk_rows_function(k, select)


def topk_rows_kernel(spec, target: tvm.target.Target) -> tirx.PrimFunc:
    """The blocked ``topk_rows`` for a GPU ``target`` (``codegen.gpu.SCHEDULE_RULES``)."""
    return topk_rows_blocked(**spec.params._asdict())
