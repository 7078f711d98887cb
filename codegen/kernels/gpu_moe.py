"""``step_kernels.moe_group`` in parallel for GPU targets: one block of THREADS threads sorts the
routed (token, slot) pairs by expert with a stable LSD radix sort, one bit of the expert id a
pass (a stable split: each thread counts the zeros of its chunk of pairs, one thread scans the
counts, each thread places its chunk). Stable, so each expert's pairs stay in token order: the
outputs are the serial kernel's exactly. Each pass ping-pongs the pair numbers between
``pair_token`` and ``token_pair``, which hold the final outputs once the passes (an even
count) are done; ``offsets[e]`` is a binary search of the sorted ids. An id of -1 (an expert
another rank holds, expert parallel) sorts as ``n_experts``: after every expert's pairs, with a
``token_pair`` of -1, as the serial kernel places them.

The CPU builds the same phases (``emulate``, ``gpu_block``), so tests compare it with the serial
kernel.
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

from dsv4c.codegen.kernels.gpu_block import block_phases

THREADS = 256


def moe_group_parallel(k: int, n_experts: int, emulate: bool = False):
    """``step_kernels.moe_group(k, n_experts)``'s outputs, in parallel (module docstring)."""
    passes = max(1, n_experts.bit_length())  # keys 0 .. n_experts (another rank's)
    passes += passes % 2  # even: the sorted pair numbers end in pair_token (a last pass on a zero bit keeps them)

    # Shared counters are read and written through a register within a phase: a shared value a
    # thread both reads and writes in a loop would make TVM place a barrier inside the loop's
    # conditions, which it cannot.
    def key(IDS, pair):  # the expert a pair sorts by
        return T.if_then_else(IDS[pair] >= 0, IDS[pair], n_experts)

    @T.macro
    def count(IDS, src, zeros, tx, total, bit):  # zeros[tx]: ids with a 0 at ``bit`` in tx's chunk
        run = T.alloc_buffer((1,), "int32", scope="local")
        run[0] = 0
        for i in range(tx * ((total + THREADS - 1) // THREADS), T.min(total, (tx + 1) * ((total + THREADS - 1) // THREADS))):
            run[0] = run[0] + 1 - T.shift_right(key(IDS, src[i]), bit) % 2
        zeros[tx] = run[0]

    @T.macro
    def scan(zeros, starts, tx):  # starts[t]: zeros before chunk t; starts[THREADS]: all zeros
        if tx == 0:
            run = T.alloc_buffer((1,), "int32", scope="local")
            run[0] = 0
            for t in range(THREADS):
                starts[t] = run[0]
                run[0] = run[0] + zeros[t]
            starts[THREADS] = run[0]

    @T.macro
    def place(IDS, src, dst, starts, tx, total, bit):  # a stable split of tx's chunk
        run = T.alloc_buffer((1,), "int32", scope="local")  # zeros before the chunk's next pair
        run[0] = starts[tx]
        for i in range(tx * ((total + THREADS - 1) // THREADS), T.min(total, (tx + 1) * ((total + THREADS - 1) // THREADS))):
            if T.shift_right(key(IDS, src[i]), bit) % 2 == 0:
                dst[run[0]] = src[i]
                run[0] = run[0] + 1
            else:
                dst[starts[THREADS] + i - run[0]] = src[i]

    @T.macro
    def first(IDS, PAIRS, OFFSETS, tx, total):  # offsets[e]: the first sorted pair of expert e or later
        for e in range(tx, n_experts + 1, THREADS):
            lo = T.alloc_buffer((2,), "int32", scope="local")  # [low, high) of the search
            lo[0] = 0
            lo[1] = total
            for _ in range(32):
                if lo[0] < lo[1]:
                    if key(IDS, PAIRS[(lo[0] + lo[1]) // 2]) < e:
                        lo[0] = (lo[0] + lo[1]) // 2 + 1
                    else:
                        lo[1] = (lo[0] + lo[1]) // 2
            OFFSETS[e] = lo[0]

    @T.macro
    def finish(IDS, PAIRS, TOKEN_PAIR, tx, total):  # token_pair[p] = its place; pair_token[place] = p's token
        for q in range(tx, total, THREADS):
            TOKEN_PAIR[PAIRS[q]] = T.if_then_else(IDS[PAIRS[q]] >= 0, q, -1)
            PAIRS[q] = PAIRS[q] // k

    @T.macro
    def init(PAIRS, tx, total):
        for q in range(tx, total, THREADS):
            PAIRS[q] = q

    block, threads, barrier, scope, _, _ = block_phases(emulate)

    @T.prim_func
    def f(ids: T.handle, offsets: T.handle, pair_token: T.handle, token_pair: T.handle):
        n = T.int32()
        IDS0 = T.match_buffer(ids, (n, k), "int32")
        OFFSETS = T.match_buffer(offsets, (n_experts + 1,), "int32")
        PAIRS = T.match_buffer(pair_token, (n * k,), "int32")
        TOKEN_PAIR0 = T.match_buffer(token_pair, (n, k), "int32")
        IDS = T.decl_buffer((n * k,), "int32", data=IDS0.data)  # ids and token_pair by pair number
        TOKEN_PAIR = T.decl_buffer((n * k,), "int32", data=TOKEN_PAIR0.data)
        for bx in block(1):
            zeros = T.alloc_buffer((THREADS,), "int32", scope=scope)
            starts = T.alloc_buffer((THREADS + 1,), "int32", scope=scope)
            for tx in threads(THREADS):
                init(PAIRS, tx, n * k)
            for half in range(passes // 2):  # bit 2 half from pair_token, 2 half + 1 back into it
                barrier()
                for tx in threads(THREADS):
                    count(IDS, PAIRS, zeros, tx, n * k, 2 * half)
                barrier()
                for tx in threads(THREADS):
                    scan(zeros, starts, tx)
                barrier()
                for tx in threads(THREADS):
                    place(IDS, PAIRS, TOKEN_PAIR, starts, tx, n * k, 2 * half)
                barrier()
                for tx in threads(THREADS):
                    count(IDS, TOKEN_PAIR, zeros, tx, n * k, 2 * half + 1)
                barrier()
                for tx in threads(THREADS):
                    scan(zeros, starts, tx)
                barrier()
                for tx in threads(THREADS):
                    place(IDS, TOKEN_PAIR, PAIRS, starts, tx, n * k, 2 * half + 1)
            barrier()
            for tx in threads(THREADS):
                first(IDS, PAIRS, OFFSETS, tx, n * k)
            barrier()
            for tx in threads(THREADS):
                finish(IDS, PAIRS, TOKEN_PAIR, tx, n * k)
    return f

def moe_group_kernel(spec, target: tvm.target.Target) -> tirx.PrimFunc:
    """The parallel ``moe_group`` for a GPU ``target`` (``codegen.gpu.SCHEDULE_RULES``)."""
    return moe_group_parallel(**spec.params._asdict())
