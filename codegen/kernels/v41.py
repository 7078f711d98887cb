"""DeepSeek-V4.1's kernels (docs/v41.md): the fake-quant round trips, the collapse of the streams
with a site's ``pre``, the shared compressor's index-key projection (its pool is
``compressor.compress_pool``'s), the
candidate-block mask of the two-level top-k and the Engram gather and gate. Each follows its
reference op (``ir.reference_v41``) in fp32, in the reference's order where a round trip follows."""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from dsv4c.artifact.engram_tables import FP32_TABLE, SCALE_COLUMNS
from dsv4c.artifact.lowbit import E2M1_MAX, E4M3_MAX, FP4_AMAX_FLOOR, FP8_AMAX_FLOOR
from dsv4c.codegen.kernels.codecs import (F32, NEG_INF, abs_bits, amax_floor, decode_e2m1, decode_e4m3fn,
                                          decode_e8m0, encode_e2m1, encode_e4m3fn)
from dsv4c.codegen.kernels.cpu import ON_STACK

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


def project_rows(out_dim: int, in_dim: int):
    """out = x @ w.T for a few rows (a KV source's index keys from its latents), fp32 weights."""
    @T.prim_func
    def f(x: T.handle, w: T.handle, out: T.handle):
        n = T.int32()
        X = T.match_buffer(x, (n, in_dim), F32)
        W = T.match_buffer(w, (out_dim, in_dim), F32)
        OUT = T.match_buffer(out, (n, out_dim), F32)
        for i in T.parallel(n * out_dim):
            acc = T.alloc_buffer((1,), F32, scope="local", annotations=ON_STACK)
            acc[0] = T.float32(0)
            for c in range(in_dim):
                acc[0] = acc[0] + X[i // out_dim, c] * W[i % out_dim, c]
            OUT[i // out_dim, i % out_dim] = acc[0]
    return f


def candidate_mask(ratio: int, block: int, blocks: int):
    """Level one of the two-level top-k (``reference_v41.candidate_mask``): per query, a block of
    ``block`` rows scores its best row; the block of the newest visible row is always kept; the
    best ``blocks`` blocks with a finite score are kept (ties to the lower block); 0 on their
    rows, -inf elsewhere. Selection by rank: a block is kept when fewer than ``blocks`` blocks
    beat it (a higher score, or the same score and a lower index)."""
    @T.macro
    def block_score(S, POS, t, e, b, out):
        out[0] = T.float32(NEG_INF)
        for j in range(block):
            if b * block + j < e:
                out[0] = T.max(out[0], S[t, b * block + j])
        if (POS[t] + 1) // ratio > 0 and b == ((POS[t] + 1) // ratio - 1) // block:
            out[0] = T.float32(INF)

    @T.prim_func
    def f(scores: T.handle, pos: T.handle, out: T.handle):
        n = T.int32()
        e = T.int32()
        S = T.match_buffer(scores, (n, e), F32)
        POS = T.match_buffer(pos, (n,), "int32")
        OUT = T.match_buffer(out, (n, e), F32)
        for i in T.parallel(n * ((e + block - 1) // block)):
            mine = T.alloc_buffer((1,), F32, scope="local", annotations=ON_STACK)
            other = T.alloc_buffer((1,), F32, scope="local", annotations=ON_STACK)
            rank = T.alloc_buffer((1,), "int32", scope="local", annotations=ON_STACK)
            block_score(S, POS, i // ((e + block - 1) // block), e, i % ((e + block - 1) // block), mine)
            rank[0] = 0
            for o in range((e + block - 1) // block):
                block_score(S, POS, i // ((e + block - 1) // block), e, o, other)
                if other[0] > mine[0] or (other[0] == mine[0] and o < i % ((e + block - 1) // block)):
                    rank[0] = rank[0] + 1
            for j in range(block):
                if i % ((e + block - 1) // block) * block + j < e:
                    OUT[i // ((e + block - 1) // block), i % ((e + block - 1) // block) * block + j] = T.if_then_else(
                        rank[0] < blocks and mine[0] > T.float32(NEG_INF), T.float32(0), T.float32(NEG_INF))
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
