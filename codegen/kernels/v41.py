"""DeepSeek-V4.1's kernels (docs/v41.md): the fake-quant round trips, the collapse of the streams
with a site's ``pre``, the image rows spliced in place of embeddings, the candidate-block mask
of the two-level top-k and the Engram gather and gate (the index-key and Engram projections are ``matmul.linear``'s, the compressor's pool
``compressor.compress_pool``'s). Each follows its
reference op (``ir.reference_v41``) in fp32, in the reference's order where a round trip follows."""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from dsv4c.artifact.engram_tables import FP32_TABLE, SCALE_COLUMNS
from dsv4c.artifact.lowbit import E2M1_MAX, E4M3_MAX, FP4_AMAX_FLOOR, FP8_AMAX_FLOOR
from dsv4c.codegen.kernels.codecs import (F32, NEG_INF, abs_bits, amax_floor, decode_e2m1, decode_e4m3fn,
                                          decode_e8m0, encode_e2m1, encode_e4m3fn)
from dsv4c.codegen.kernels.cpu import ON_STACK
from dsv4c.codegen.kernels.topk import TOPK_LANES, kth_key_macros, order_key

INF = float("inf")
ROUNDTRIP_BLOCK = {"fp8_b32": 32, "fp4_b32": 32, "fp4_e4m3_b16": 16}


def _pow2_ceil(ratio):
    """``lowbit.pow2_ceil`` of a normal (or inf / NaN) float32: exact powers stay, others round up."""
    bits = tirx.reinterpret("int32", ratio)
    exp_field = bits >> 23
    exact = tirx.Or((bits & 0x7FFFFF) == 0, exp_field == 255)
    return tirx.reinterpret(F32, tirx.Select(exact, bits, tirx.shift_left(exp_field + 1, 23)))


def _scale(amax, fmt: str):
    """The block scale ``lowbit.v41_roundtrip`` takes for a block whose largest magnitude is amax."""
    if fmt == "fp8_b32":
        return _pow2_ceil(amax_floor(amax, FP8_AMAX_FLOOR) * tirx.const(1 / E4M3_MAX, F32))
    if fmt == "fp4_b32":
        return _pow2_ceil(amax_floor(amax, FP4_AMAX_FLOOR) * tirx.const(1 / E2M1_MAX, F32))
    q = amax_floor(amax, E2M1_MAX * 2.0**-9) / tirx.const(E2M1_MAX, F32)
    return decode_e4m3fn(tirx.Cast("uint8", encode_e4m3fn(q)))


def _roundtrip(x, fmt: str):
    if fmt == "fp8_b32":
        return decode_e4m3fn(tirx.Cast("uint8", encode_e4m3fn(x)))
    return decode_e2m1(tirx.Cast("uint8", encode_e2m1(x)))


def v41_roundtrip(width: int, fmt: str):
    """Rows of ``width`` values through V4.1's round trip ``fmt`` (``lowbit.v41_roundtrip``), block
    by block: the block's scale from its largest magnitude, then each value divided by it,
    rounded onto the format's grid and multiplied back."""
    block = ROUNDTRIP_BLOCK[fmt]

    @T.prim_func
    def f(x: T.handle, out: T.handle):
        n = T.int32()
        X = T.match_buffer(x, (n, width), F32)
        OUT = T.match_buffer(out, (n, width), F32)
        for i in T.parallel(n * (width // block)):
            amax = T.alloc_buffer((1,), "int32", scope="local", annotations=ON_STACK)
            s = T.alloc_buffer((1,), F32, scope="local", annotations=ON_STACK)
            v = T.alloc_buffer((1,), F32, scope="local", annotations=ON_STACK)
            amax[0] = 0
            for j in range(block):
                amax[0] = T.max(amax[0], abs_bits(X[i // (width // block), i % (width // block) * block + j]))
            s[0] = _scale(T.reinterpret(F32, amax[0]), fmt)
            for j in range(block):
                v[0] = X[i // (width // block), i % (width // block) * block + j] / s[0]
                OUT[i // (width // block), i % (width // block) * block + j] = _roundtrip(v[0], fmt) * s[0]
    return f


def hc_collapse(hc: int, dim: int, weighted: bool):
    """``sum_j pre[j] * h[j]`` in stream order; unweighted: stream 0."""
    @T.prim_func
    def f(h: T.handle, pre: T.handle, out: T.handle):
        n = T.int32()
        H = T.match_buffer(h, (n, hc, dim), F32)
        PRE = T.match_buffer(pre, (n, hc), F32)
        OUT = T.match_buffer(out, (n, dim), F32)
        for t in T.parallel(n):
            for d in range(dim):
                if weighted:
                    OUT[t, d] = PRE[t, 0] * H[t, 0, d]
                    for j in range(1, hc):
                        OUT[t, d] = OUT[t, d] + PRE[t, j] * H[t, j, d]
                else:
                    OUT[t, d] = H[t, 0, d]
    return f


def image_splice(dim: int):
    """``x`` with token t's row replaced by ``rows[index[t]]`` where that is >= 0 (an image
    span's position)."""
    @T.prim_func
    def f(x: T.handle, index: T.handle, rows: T.handle, out: T.handle):
        n, m = T.int32(), T.int32()
        X = T.match_buffer(x, (n, dim), F32)
        INDEX = T.match_buffer(index, (n,), "int32")
        ROWS = T.match_buffer(rows, (m, dim), F32)
        OUT = T.match_buffer(out, (n, dim), F32)
        for t in T.parallel(n):
            for j in range(dim):
                OUT[t, j] = T.if_then_else(INDEX[t] >= 0, ROWS[T.max(INDEX[t], 0), j], X[t, j])
    return f


def candidate_block_scores(ratio: int, block: int):
    """Level one of the two-level top-k (``reference_v41.candidate_mask``), its first half: per
    query, each block of ``block`` rows of the index scores [N, E] scores its best row, and the
    block of the newest visible row scores +inf (always kept): [N, ceil(E / block)]."""
    @T.prim_func
    def f(scores: T.handle, pos: T.handle, out: T.handle):
        n = T.int32()
        e = T.int32()
        nb = T.int32()
        S = T.match_buffer(scores, (n, e), F32)
        POS = T.match_buffer(pos, (n,), "int32")
        OUT = T.match_buffer(out, (n, nb), F32)
        for i in T.parallel(n * nb):
            best = T.alloc_buffer((1,), F32, scope="local", annotations=ON_STACK)
            best[0] = T.float32(NEG_INF)
            for j in range(block):
                if i % nb * block + j < e:
                    best[0] = T.max(best[0], S[i // nb, i % nb * block + j])
            if (POS[i // nb] + 1) // ratio > 0 and i % nb == ((POS[i // nb] + 1) // ratio - 1) // block:
                best[0] = T.float32(INF)
            OUT[i // nb, i % nb] = best[0]
    return f


def candidate_mask(block: int, blocks: int, *, max_lanes: int = 0):
    """The second half: per query, 0 on the rows of the ``blocks`` best blocks with a finite
    score (ties to the lower block), NEG_INF elsewhere, [N, E]. The blocks are selected as
    ``topk.topk_rows`` selects columns (the k-th largest block score by binary search, then one
    pass), in O(blocks) vector steps per query: their order is not needed. GPU builds
    (``max_lanes``) count that many columns at a time, a thread per query."""
    lanes = max_lanes or TOPK_LANES
    _, _, kth_key = kth_key_macros(lanes)

    @T.prim_func
    def f(block_scores: T.handle, out: T.handle):
        n = T.int32()
        nb = T.int32()
        e = T.int32()
        BS = T.match_buffer(block_scores, (n, nb), F32)
        OUT = T.match_buffer(out, (n, e), F32)
        for t in T.parallel(n):
            threshold = T.alloc_buffer((1,), "int32", scope="local", annotations=ON_STACK)
            ties = T.alloc_buffer((1,), "int32", scope="local", annotations=ON_STACK)
            key = T.alloc_buffer((1,), "int32", scope="local", annotations=ON_STACK)
            kept = T.alloc_buffer((1,), F32, scope="local", annotations=ON_STACK)
            kth_key(BS, t, nb, blocks, threshold, ties)
            for b in range(nb):
                key[0] = order_key(BS[t, b])
                kept[0] = T.float32(NEG_INF)
                if key[0] > threshold[0] or (key[0] == threshold[0] and ties[0] > 0):
                    if key[0] == threshold[0]:
                        ties[0] = ties[0] - 1
                    kept[0] = T.float32(0)
                for j in range(block):
                    if b * block + j < e:
                        OUT[t, b * block + j] = kept[0]
    return f


def engram_gather(head_dim: int, columns: int, slots: int, slot: int, fmt: str):
    """Each token's Engram table rows, side by side in hash-column order: [T, columns * head_dim],
    from its layer's table of any number of rows (the whole table, or a step's gather of it),
    FP8 rows decoded as ``e4m3(code) * 2^(scale - 127)`` (``artifact.engram_tables``). Row offsets
    are int64: a released table holds more than 2**31 values."""
    if fmt == FP32_TABLE:
        @T.prim_func
        def f(ids: T.handle, table: T.handle, out: T.handle):
            n = T.int32()
            r = T.int64()
            IDS = T.match_buffer(ids, (n, slots, columns), "int32")
            TAB = T.match_buffer(table, (r, head_dim), F32)
            OUT = T.match_buffer(out, (n, columns * head_dim), F32)
            for i in T.parallel(n * columns):
                for d in range(head_dim):
                    OUT[i // columns, i % columns * head_dim + d] = \
                        TAB[T.Cast("int64", IDS[i // columns, slot, i % columns]), d]
        return f
    groups = -(-head_dim // SCALE_COLUMNS)

    @T.prim_func
    def g(ids: T.handle, table: T.handle, scales: T.handle, out: T.handle):
        n = T.int32()
        r = T.int64()
        IDS = T.match_buffer(ids, (n, slots, columns), "int32")
        TAB = T.match_buffer(table, (r, head_dim), "uint8")
        SC = T.match_buffer(scales, (r, groups), "uint8")
        OUT = T.match_buffer(out, (n, columns * head_dim), F32)
        for i in T.parallel(n * columns):
            for d in range(head_dim):
                OUT[i // columns, i % columns * head_dim + d] = \
                    decode_e4m3fn(TAB[T.Cast("int64", IDS[i // columns, slot, i % columns]), d]) * \
                    decode_e8m0(SC[T.Cast("int64", IDS[i // columns, slot, i % columns]), d // SCALE_COLUMNS])
    return g


def engram_gate(hc: int, dim: int, eps: float):
    """h'[k] = h[k] + sigmoid(signed sqrt of the normalised dot of stream k, q*k weights and key k)
    * value (``reference_v41.engram``), per token."""
    @T.prim_func
    def f(h: T.handle, kv: T.handle, qw: T.handle, kw: T.handle, out: T.handle):
        n = T.int32()
        H = T.match_buffer(h, (n, hc, dim), F32)
        KV = T.match_buffer(kv, (n, (hc + 1) * dim), F32)
        QW = T.match_buffer(qw, (hc, dim), F32)
        KW = T.match_buffer(kw, (hc, dim), F32)
        OUT = T.match_buffer(out, (n, hc, dim), F32)
        for i in T.parallel(n * hc):
            acc = T.alloc_buffer((4,), F32, scope="local", annotations=ON_STACK)  # h^2, key^2, dot, gate
            acc[0] = T.float32(0)
            acc[1] = T.float32(0)
            acc[2] = T.float32(0)
            for d in range(dim):
                acc[0] = acc[0] + H[i // hc, i % hc, d] * H[i // hc, i % hc, d]
                acc[1] = acc[1] + KV[i // hc, i % hc * dim + d] * KV[i // hc, i % hc * dim + d]
                acc[2] = acc[2] + H[i // hc, i % hc, d] * (QW[i % hc, d] * KW[i % hc, d]) * KV[i // hc, i % hc * dim + d]
            acc[3] = acc[2] * ((T.float32(1) / T.sqrt(acc[0] / T.float32(dim) + T.float32(eps))) *
                               (T.float32(1) / T.sqrt(acc[1] / T.float32(dim) + T.float32(eps)))) * \
                T.float32(dim ** -0.5)
            acc[3] = T.float32(1) / (T.float32(1) + T.exp(-T.if_then_else(
                T.reinterpret("int32", acc[3]) < 0,
                -T.sqrt(T.max(T.fabs(acc[3]), T.float32(1e-6))), T.sqrt(T.max(T.fabs(acc[3]), T.float32(1e-6))))))
            for d in range(dim):
                OUT[i // hc, i % hc, d] = H[i // hc, i % hc, d] + acc[3] * KV[i // hc, hc * dim + d]
    return f
