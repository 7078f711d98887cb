"""Decode's GEMVs for GPU targets (``linear`` with ``gemv``, and ``expert_linear`` flagged
``decode``): a block per (column tile, group or expert), its threads across the tile's columns,
so that a warp reads consecutive weight words.

Weights are stored in column tiles ``[(G or E,) O / tile, I, tile]`` (``formats``): for one input
(or FP4 word of eight inputs) a tile's columns lie side by side, so thread c of the block reads
column c, and the 32 threads of a warp read 32 consecutive words (FP4: 128 bytes, eight inputs
each). SPLIT groups of threads take a contiguous quarter of the inputs each; x is read by every
thread of a warp at once (one broadcast). Per pass of ROWS rows each thread sums its inputs'
products for every row in registers (each weight decoded once for all of them), then the tile's
columns add their SPLIT partial sums in order through shared memory.

``linear`` GEMVs: every row, of each group of a grouped projection; dlight's GEMV schedule of
the compute definition, which this replaces, ran a thread per output over all inputs, so a
4096-column projection of one token filled 4 blocks. ``expert_linear``: each expert's group of
rows (decode steps give an expert at most one row per token); the tensor-core kernel that runs
prefill's expert GEMMs (``kernels.gpu_matmul``) would spend 64-row fragments on them and read
each weight tile in fragment order. An expert without rows reads nothing.

Numerics: each weight decoded to its float32 value (code x scale), summed in input order within
a split, the splits added in order: within rounding of the CPU kernels (which sum each scale
group raw and scale it once), not bit for bit. The CPU builds the same phases (``emulate``,
``gpu_block``), so tests compare them with the CPU kernels.
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

from dsv4c.codegen.kernels.codecs import F32
from dsv4c.codegen.kernels.formats import column_tile, tir_format
from dsv4c.codegen.kernels.gpu_block import block_phases
from dsv4c.codegen.kernels.matmul import expert_linear_function

SPLIT = 4  # thread groups along the inputs: 64-column tiles make blocks of 256 threads
ROWS = 4  # rows a pass takes (decode steps have at most 4 tokens)


def _gemv(fmt, out_dim: int, in_dim: int, leads: int, emulate: bool, x_index, y_index, first, count):
    """The grid over (column tile, lead) of ``leads`` groups or experts (module docstring).
    Lead g's rows are first(bounds, g) + 0 .. count(bounds, g) (``bounds``: the kernel's
    offsets, or its row count); ``x_index`` / ``y_index`` (g, row, input / column) place them."""
    tile = column_tile(out_dim)
    tiles = out_dim // tile
    threads = tile * SPLIT
    per_word = fmt.inputs_per_word
    words = in_dim // per_word
    span = -(-words // SPLIT)  # words of a split
    block_loop, thread_loop, barrier, scope, registers, own = block_phases(emulate)

    @T.macro
    def grid(X, parts, Y, bounds):
        for job in block_loop(leads * tiles):  # lead job % leads, column tile job // leads
            partial = T.alloc_buffer((SPLIT * ROWS * tile,), F32, scope=scope)
            acc = T.alloc_buffer((threads if emulate else 1, ROWS), F32, scope=registers)
            weight = T.alloc_buffer((threads if emulate else 1,), F32, scope=registers)
            for rp in range((count(bounds, job % leads) + ROWS - 1) // ROWS):
                barrier()
                for tx in thread_loop(threads):  # split tx // tile, column tx % tile
                    for r in T.unroll(ROWS):
                        acc[tx * own, r] = T.float32(0)
                    for kw in range(tx // tile * span, T.min(words, (tx // tile + 1) * span)):
                        for j in T.unroll(per_word):
                            weight[tx * own] = fmt.value(parts, (job % leads,) if leads > 1 else (), job // leads,
                                                         kw * per_word + j, tx % tile)
                            for r in T.unroll(ROWS):
                                acc[tx * own, r] = acc[tx * own, r] + T.if_then_else(
                                    rp * ROWS + r < count(bounds, job % leads),
                                    X[x_index(job % leads, first(bounds, job % leads) + rp * ROWS + r,
                                              kw * per_word + j)], T.float32(0)) * weight[tx * own]
                    for r in T.unroll(ROWS):
                        partial[(tx // tile * ROWS + r) * tile + tx % tile] = acc[tx * own, r]
                barrier()
                for tx in thread_loop(threads):
                    if tx < tile:
                        for r in T.unroll(ROWS):
                            if rp * ROWS + r < count(bounds, job % leads):
                                acc[tx * own, r] = partial[r * tile + tx]
                                for s in range(1, SPLIT):
                                    acc[tx * own, r] = acc[tx * own, r] + partial[(s * ROWS + r) * tile + tx]
                                Y[y_index(job % leads, first(bounds, job % leads) + rp * ROWS + r,
                                          job // leads * tile + tx)] = acc[tx * own, r]
    return grid


def expert_gemv(out_dim: int, in_dim: int, quant: str, n_experts: int, emulate: bool = False):
    """``matmul.expert_linear``'s outputs (x [P, I], offsets [E + 1], stacked weights -> y [P, O],
    the same arguments), for decode's few rows per expert (module docstring)."""
    grid = _gemv(tir_format(quant), out_dim, in_dim, n_experts, emulate, lambda e, p, k: (p, k),
                 lambda e, p, o: (p, o), lambda off, e: off[e], lambda off, e: off[e + 1] - off[e])

    @T.macro
    def run(X, OFF, parts, Y):
        grid(X, parts, Y, OFF)
    return expert_linear_function(out_dim, in_dim, quant, n_experts, run).with_attr("tirx.noalias", True)


def linear_gemv(out_dim: int, in_dim: int, quant: str, groups: int = 0, emulate: bool = False):
    """``matmul.linear``'s GEMV (x [N, (G,) I], weights [(G,) O / tile, I, tile] -> y [N, (G,) O],
    the same arguments) over every row of each group (module docstring)."""
    fmt = tir_format(quant)
    lead = (groups,) if groups else ()
    storage = [(lead + shape, dtype) for shape, dtype in fmt.parts(out_dim, in_dim)]
    (w_shape, w_dtype), (s_shape, s_dtype) = storage[0], storage[-1]
    grouped = (lambda g, n, i: (n, g, i)) if groups else (lambda g, n, i: (n, i))
    grid = _gemv(fmt, out_dim, in_dim, max(groups, 1), emulate, grouped, grouped, lambda rows, g: 0,
                 lambda rows, g: rows)
    x_shape = lambda n: (n,) + lead + (in_dim,)  # noqa: E731
    y_shape = lambda n: (n,) + lead + (out_dim,)  # noqa: E731

    if len(storage) == 2:
        @T.prim_func
        def f(x: T.handle, w: T.handle, s: T.handle, y: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int32()
            X = T.match_buffer(x, x_shape(n), F32)
            W = T.match_buffer(w, w_shape, w_dtype)
            S = T.match_buffer(s, s_shape, s_dtype)
            Y = T.match_buffer(y, y_shape(n), F32)
            grid(X, (W, S), Y, n)
        return f

    @T.prim_func
    def f(x: T.handle, w: T.handle, y: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int32()
        X = T.match_buffer(x, x_shape(n), F32)
        W = T.match_buffer(w, w_shape, w_dtype)
        Y = T.match_buffer(y, y_shape(n), F32)
        grid(X, (W,), Y, n)
    return f


def decode_gemv(spec) -> bool:
    """Whether ``spec`` is a decode GEMV: ``linear`` with gemv set, ``expert_linear`` with decode set."""
    return (spec.factory == "linear" and spec.params.gemv) or (spec.factory == "expert_linear" and spec.params.decode)


def gemv_kernel(spec, target: tvm.target.Target) -> tirx.PrimFunc | None:
    """The decode GEMV for a GPU ``target``; None for any other kernel."""
    if not decode_gemv(spec):
        return None
    p = spec.params
    if spec.factory == "linear":
        return linear_gemv(p.out_dim, p.in_dim, p.quant, p.groups)
    return expert_gemv(p.out_dim, p.in_dim, p.quant, p.n_experts)
