"""Tensor-core GEMMs for GPU targets: prefill's ``linear`` GEMM and ``expert_linear``, on MMA
(sm90: ``mma.sync.m16n8k16`` f16 x f16 + f32) and MFMA (gfx942 / gfx950: ``v_mfma_f32_16x16x16f16``).

A block computes ROWS x COLUMNS outputs of one group (a grouped projection's group, or an
expert) with 2 x 2 warps; a warp holds 2 x 2 fragments of 16 x 16 float32 sums in registers and
runs over the inputs 16 at a time: each lane loads its slots of the x and weight fragments
straight from global memory (x rounded to float16; weights decoded by ``TirFormat.value``, code
x scale in float32, then rounded to float16), the tensor-core instruction adds their product to
the sums, and each lane finally writes its slots of the sums to y (the prefill GEMM's [B, 8,
(G,) O]; an expert's rows at its offset, offsets[e] <= p < offsets[e + 1]). Rows past the
matrix's, or past the expert's group, are zero and not written; an expert's block whose first
row is past its group does nothing. Where each (row, input) of a fragment sits in which lane
and slot is the instruction's (``Layout``: PTX's m16n8k16 fragments; the MFMA's, as TVM's ROCm
intrinsics lay them out).

The CPU builds the same kernel (``emulate``): the block and warp loops run in turn, each warp
op runs for all lanes, and the tensor-core instruction is replaced by its definition on the
same fragment layout, so its tiling, masking, decoding and row mapping are tested on the CPU
against numpy (the instruction's own lane layout is then the only part a GPU has to confirm).

Numerics: the products are those of float16 operands, summed in float32 by the tensor cores (in
their order, not input order). Rounding x to float16 (11 significant bits) gives each product a
relative error of at most 2**-11; a decoded weight is exact in float16 where the format's value
is (FP4 codes times E8M0 scales in float16's range, BF16 values in its range); FP8 code x block
scale and fp32 weights round to 11 bits, and values under 2**-14 lose bits as float16
subnormals. A dot product of n terms thus differs from the CPU kernels' by about
2**-11 * sqrt(n) * rms(x * w) (a few times that at most): ~1e-3 of the output's scale at
n = 4096. x must stay within float16's range (|x| < 65504): normalised activations and the
SwiGLU's clamped outputs do.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import tvm
from tvm import tirx
from tvm.script import tirx as T

from dsv4c.codegen.kernels.codecs import F32
from dsv4c.codegen.kernels.formats import column_tile, tir_format
from dsv4c.codegen.kernels.gpu_gemv import decode_gemv
from dsv4c.codegen.kernels.matmul import GEMM_ROWS, expert_linear_function
from dsv4c.errors import DsvError

F16 = "float16"
FRAGMENT = 16  # a tensor-core tile: 16 x 16 outputs, 16 inputs
WARPS = 2  # warps of a block along rows, and along columns
WARP_FRAGMENTS = 2  # fragments of a warp along rows, and along columns: 32 x 32 outputs
WARP_SPAN = FRAGMENT * WARP_FRAGMENTS
ROWS = COLUMNS = WARP_SPAN * WARPS  # a block's tile of outputs


class MmaTargetError(DsvError):
    """No tensor-core GEMM for this target."""


@dataclass(frozen=True)
class Layout:
    """Which (row, column) of a 16 x 16 fragment lane l's slot s holds, for the x fragment
    (row, input), the weight fragment (input, column) and the sums (row, column)."""
    lanes: int
    slots: int  # slots of each fragment in a lane's registers
    x: Callable
    w: Callable
    sums: Callable


# PTX ISA, "Matrix Fragments for mma.m16n8k16" (f16 inputs, f32 sums): lane l = 4 g + t; a 16 x 16
# sum fragment is two m16n8 ones, slots 0-3 the first eight columns, 4-7 the others.
CUDA_LAYOUT = Layout(
    32, 8,
    x=lambda l, s: (l // 4 + 8 * (s // 2 % 2), 2 * (l % 4) + s % 2 + 8 * (s // 4)),
    w=lambda l, s: (2 * (l % 4) + s % 2 + 8 * (s // 2 % 2), l // 4 + 8 * (s // 4)),
    sums=lambda l, s: (l // 4 + 8 * (s // 2 % 2), 2 * (l % 4) + s % 2 + 8 * (s // 4)))
# v_mfma_f32_16x16x16f16 on 64 lanes (tvm.s_tir.tensor_intrin.rocm's layouts A, B and C).
ROCM_LAYOUT = Layout(
    64, 4,
    x=lambda l, s: (l % 16, 4 * (l // 16) + s),
    w=lambda l, s: (4 * (l // 16) + s, l % 16),
    sums=lambda l, s: (4 * (l // 16) + s, l % 16))


def target_layout(target: tvm.target.Target) -> Layout:
    if target.kind.name == "cuda":
        return CUDA_LAYOUT
    if target.kind.name == "rocm":
        return ROCM_LAYOUT
    raise MmaTargetError(f"no tensor-core GEMM for target kind {target.kind.name!r}")


def mma_shape_ok(out_dim: int, in_dim: int) -> bool:
    """Whether a matmul of these sizes tiles onto tensor cores: whole blocks of columns within a
    weight's column tiles, whole fragments of inputs; others keep the generic GPU schedule."""
    return out_dim % COLUMNS == 0 and column_tile(out_dim) % COLUMNS == 0 and in_dim % FRAGMENT == 0


def _row_tiles(rows):
    """Blocks of ROWS rows that cover ``rows``."""
    return tirx.floordiv(rows + ROWS - 1, ROWS)


def _gemm(fmt, out_dim: int, in_dim: int, layout: Layout, emulate: bool, x_index, y_index, first, count):
    """The kernel's loops over groups x row tiles x column tiles (``grid``), each a block of warps
    (module docstring). Group s's rows are first(bounds, s) + 0 .. count(bounds, s) (``bounds``:
    the kernel's offsets, or its count of row blocks); ``x_index`` / ``y_index`` (s, row, input
    or column) index x and y."""
    tile = column_tile(out_dim)
    lanes, slots = layout.lanes, layout.slots
    held = lanes if emulate else 1  # lanes whose registers a thread holds: all when emulated
    if emulate:
        block_loop = warp_loop = T.serial
    else:
        block_loop = {tag: functools.partial(T.thread_binding, thread=tag)
                      for tag in ("blockIdx.x", "blockIdx.y", "blockIdx.z")}.get
        warp_loop = functools.partial(T.thread_binding, thread="threadIdx.y")
    lane_loop = T.serial if emulate else functools.partial(T.thread_binding, thread="threadIdx.x")

    def grid_loop(tag):
        return T.serial if emulate else block_loop(tag)

    @T.macro
    def mma(acc, xf, wf, i, j):  # acc[i, j] += xf[i] @ wf[j], all held lanes
        if emulate:
            fx = T.alloc_buffer((FRAGMENT, FRAGMENT), F32, scope="local")
            fw = T.alloc_buffer((FRAGMENT, FRAGMENT), F32, scope="local")
            fs = T.alloc_buffer((FRAGMENT, FRAGMENT), F32, scope="local")
            for li, q in T.grid(lanes, slots):
                fx[layout.x(li, q)] = T.Cast(F32, xf[li, i, q])
                fw[layout.w(li, q)] = T.Cast(F32, wf[li, j, q])
                fs[layout.sums(li, q)] = acc[li, i, j, q]
            for r, c, k in T.grid(FRAGMENT, FRAGMENT, FRAGMENT):
                fs[r, c] = fs[r, c] + fx[r, k] * fw[k, c]
            for li, q in T.grid(lanes, slots):
                acc[li, i, j, q] = fs[layout.sums(li, q)]
        elif lanes == 32:  # two m16n8k16: the fragment's first eight columns, then the others
            T.evaluate(T.ptx_legacy.mma("m16n8k16", "row", "col", "fp16", "fp16", "fp32", xf.data, i * slots, wf.data,
                                        j * slots, acc.data, (i * WARP_FRAGMENTS + j) * slots, False, dtype=F32))
            T.evaluate(T.ptx_legacy.mma("m16n8k16", "row", "col", "fp16", "fp16", "fp32", xf.data, i * slots, wf.data,
                                        j * slots + slots // 2, acc.data, (i * WARP_FRAGMENTS + j) * slots + slots // 2,
                                        False, dtype=F32))
        else:
            acc[0, i, j, T.ramp(0, 1, slots)] = T.call_llvm_pure_intrin(
                T.llvm_lookup_intrinsic_id("llvm.amdgcn.mfma.f32.16x16x16f16"), xf[0, i, T.ramp(0, 1, slots)],
                wf[0, j, T.ramp(0, 1, slots)], acc[0, i, j, T.ramp(0, 1, slots)], T.int32(0), T.int32(0), T.int32(0),
                dtype=f"{F32}x{slots}")

    @T.macro
    def block(X, parts, Y, s, start, count, bm, bn):  # rows bm * ROWS .., columns bn * COLUMNS .. of group s
        for warp in warp_loop(WARPS * WARPS):
            for tx in lane_loop(1 if emulate else lanes):
                acc = T.alloc_buffer((held, WARP_FRAGMENTS, WARP_FRAGMENTS, slots), F32, scope="local")
                xf = T.alloc_buffer((held, WARP_FRAGMENTS, slots), F16, scope="local")
                wf = T.alloc_buffer((held, WARP_FRAGMENTS, slots), F16, scope="local")
                for li, i, j, q in T.grid(held, WARP_FRAGMENTS, WARP_FRAGMENTS, slots):
                    acc[li, i, j, q] = T.float32(0)
                if bm * ROWS < count:  # an expert's tile past its group does nothing
                    for k0 in range(in_dim // FRAGMENT):
                        for li, i, q in T.grid(held, WARP_FRAGMENTS, slots):
                            xf[li, i, q] = T.Cast(F16, T.if_then_else(
                                bm * ROWS + warp // WARPS * WARP_SPAN + i * FRAGMENT + layout.x(tx + li, q)[0] < count,
                                X[x_index(s, start + bm * ROWS + warp // WARPS * WARP_SPAN + i * FRAGMENT
                                          + layout.x(tx + li, q)[0], k0 * FRAGMENT + layout.x(tx + li, q)[1])],
                                T.float32(0)))
                        for li, j, q in T.grid(held, WARP_FRAGMENTS, slots):
                            wf[li, j, q] = T.Cast(F16, fmt.value(
                                parts, (s,), bn * COLUMNS // tile, k0 * FRAGMENT + layout.w(tx + li, q)[0],
                                bn * COLUMNS % tile + warp % WARPS * WARP_SPAN + j * FRAGMENT + layout.w(tx + li, q)[1]))
                        for i, j in T.grid(WARP_FRAGMENTS, WARP_FRAGMENTS):
                            mma(acc, xf, wf, i, j)
                for li, i, j, q in T.grid(held, WARP_FRAGMENTS, WARP_FRAGMENTS, slots):
                    if bm * ROWS + warp // WARPS * WARP_SPAN + i * FRAGMENT + layout.sums(tx + li, q)[0] < count:
                        Y[y_index(s, start + bm * ROWS + warp // WARPS * WARP_SPAN + i * FRAGMENT
                                  + layout.sums(tx + li, q)[0],
                                  bn * COLUMNS + warp % WARPS * WARP_SPAN + j * FRAGMENT
                                  + layout.sums(tx + li, q)[1])] = acc[li, i, j, q]

    @T.macro
    def grid(X, parts, Y, groups, row_tiles, bounds):
        for s in grid_loop("blockIdx.z")(groups):
            for bm in grid_loop("blockIdx.y")(row_tiles):
                for bn in grid_loop("blockIdx.x")(out_dim // COLUMNS):
                    block(X, parts, Y, s, first(bounds, s), count(bounds, s), bm, bn)

    return grid


def mma_linear(out_dim: int, in_dim: int, quant: str, groups: int, layout: Layout, emulate: bool = False):
    """The prefill GEMM of ``matmul.linear`` (x [(G,) B, 8, I] -> y [B, 8, (G,) O], the same
    arguments) on tensor cores of ``layout``, or emulated on the CPU."""
    fmt = tir_format(quant)
    g = max(groups, 1)
    lead = (groups,) if groups else ()
    storage = fmt.parts(out_dim, in_dim)
    (w_shape, w_dtype), (s_shape, s_dtype) = storage[0], storage[-1]
    grid = _gemm(fmt, out_dim, in_dim, layout, emulate, lambda s, r, k: (s, r, k), lambda s, r, o: (r, s, o),
                 lambda n, s: 0, lambda n, s: n * GEMM_ROWS)

    if len(storage) == 2:
        @T.prim_func
        def f(x: T.handle, w: T.handle, s: T.handle, y: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int32()
            X0 = T.match_buffer(x, lead + (n, GEMM_ROWS, in_dim), F32)
            W0 = T.match_buffer(w, lead + w_shape, w_dtype)
            S0 = T.match_buffer(s, lead + s_shape, s_dtype)
            Y0 = T.match_buffer(y, (n, GEMM_ROWS) + lead + (out_dim,), F32)
            X = T.decl_buffer((g, n * GEMM_ROWS, in_dim), F32, data=X0.data)
            W = T.decl_buffer((g,) + w_shape, w_dtype, data=W0.data)
            S = T.decl_buffer((g,) + s_shape, s_dtype, data=S0.data)
            Y = T.decl_buffer((n * GEMM_ROWS, g, out_dim), F32, data=Y0.data)
            grid(X, (W, S), Y, g, _row_tiles(n * GEMM_ROWS), n)
        return f

    @T.prim_func
    def f(x: T.handle, w: T.handle, y: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int32()
        X0 = T.match_buffer(x, lead + (n, GEMM_ROWS, in_dim), F32)
        W0 = T.match_buffer(w, lead + w_shape, w_dtype)
        Y0 = T.match_buffer(y, (n, GEMM_ROWS) + lead + (out_dim,), F32)
        X = T.decl_buffer((g, n * GEMM_ROWS, in_dim), F32, data=X0.data)
        W = T.decl_buffer((g,) + w_shape, w_dtype, data=W0.data)
        Y = T.decl_buffer((n * GEMM_ROWS, g, out_dim), F32, data=Y0.data)
        grid(X, (W,), Y, g, _row_tiles(n * GEMM_ROWS), n)
    return f


def mma_expert_linear(out_dim: int, in_dim: int, quant: str, n_experts: int, layout: Layout, emulate: bool = False):
    """``matmul.expert_linear`` (x [P, I], offsets [E + 1], stacked weights -> y [P, O], the same
    arguments) on tensor cores of ``layout``, or emulated on the CPU: expert e's rows are
    offsets[e] <= p < offsets[e + 1]; every expert gets the row tiles of all P rows, and those
    past its group return at once."""
    grid = _gemm(tir_format(quant), out_dim, in_dim, layout, emulate, lambda s, r, k: (r, k), lambda s, r, o: (r, o),
                 lambda off, s: off[s], lambda off, s: off[s + 1] - off[s])

    @T.macro
    def run(X, OFF, parts, Y):
        grid(X, parts, Y, n_experts, _row_tiles(X.shape[0]), OFF)
    return expert_linear_function(out_dim, in_dim, quant, n_experts, run).with_attr("tirx.noalias", True)


def mma_kernel(spec, target: tvm.target.Target) -> tirx.PrimFunc | None:
    """The tensor-core kernel for a prefill GEMM (``linear`` with gemv False) or prefill's
    ``expert_linear`` whose sizes tile (:func:`mma_shape_ok`); None for any other kernel (decode's
    GEMVs are ``kernels.gpu_gemv``'s)."""
    if spec.factory not in ("linear", "expert_linear") or decode_gemv(spec):
        return None
    p = spec.params
    if not mma_shape_ok(p.out_dim, p.in_dim):
        return None
    if spec.factory == "linear":
        return mma_linear(p.out_dim, p.in_dim, p.quant, p.groups, target_layout(target))
    return mma_expert_linear(p.out_dim, p.in_dim, p.quant, p.n_experts, target_layout(target))
