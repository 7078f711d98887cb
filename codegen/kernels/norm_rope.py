"""The residual stream's row kernels: the token embedding, rmsnorm, the GPT-J rotation (rope), the
two fused per head (rmsnorm_rope), and the residual add."""

from __future__ import annotations

import math

from tvm.script import tirx as T

from dsv4c.codegen.kernels.codecs import F32
from dsv4c.codegen.kernels.cpu import ON_STACK, cpu_vector


def embed(vocab: int, dim: int):
    @T.prim_func
    def f(tok: T.handle, tab: T.handle, out: T.handle):
        n = T.int32()
        TOK = T.match_buffer(tok, (n,), "int32")
        TAB = T.match_buffer(tab, (vocab, dim), F32)
        OUT = T.match_buffer(out, (n, dim), F32)
        for i in T.parallel(n):
            for j in range(dim):  # a token of -1 is another rank's vocab row (shard_ids): zeros
                OUT[i, j] = T.if_then_else(TOK[i] >= 0, TAB[T.max(TOK[i], 0), j], T.float32(0))
    return f


def rmsnorm(dim: int, eps: float, weighted: bool):
    @T.prim_func
    def f(x: T.handle, w: T.handle, out: T.handle):
        n = T.int32()
        X = T.match_buffer(x, (n, dim), F32)
        W = T.match_buffer(w, (dim,), F32)
        OUT = T.match_buffer(out, (n, dim), F32)
        for i in T.parallel(n):
            acc = T.alloc_buffer((1,), F32, scope="local", annotations=ON_STACK)
            acc[0] = T.float32(0)
            for j in range(dim):
                acc[0] = acc[0] + X[i, j] * X[i, j]
            for j in range(dim):
                OUT[i, j] = X[i, j] * (T.float32(1) / T.sqrt(acc[0] / T.float32(dim) + T.float32(eps))) * \
                    T.if_then_else(weighted, W[j], T.float32(1))
    return f


ROPE_HEAD_BLOCK = 8  # heads per parallel job of the rope kernels, which share one token's cos / sin


# A job of the rope kernels is (token, block of hb heads). Their indices are written out where
# they are used: named (a Bind), each one cost a workspace allocation per head on the CPU.
def _job_token(job, heads: int, hb: int):
    return job // (heads // hb)


def _job_head(job, heads: int, hb: int, hh):
    return job % (heads // hb) * hb + hh


def _rotation(half: int):
    """A macro that fills trig[p] = (cos, sin) of the angle of pair p at token i's position."""
    @T.macro
    def rotation(POS, INV, i, trig):
        for p in range(half):
            trig[p, 0] = T.cos(T.Cast(F32, POS[i]) * INV[p])
            trig[p, 1] = T.sin(T.Cast(F32, POS[i]) * INV[p])
    return rotation


def _pair_rotation(half: int, nope: int, value, sign: float = 1.0):
    """A macro that writes the GPT-J rotation of channel pairs (nope + 2p, nope + 2p + 1) of
    token i's head h: OUT from ``value(src, i, h, channel)``, the channel's value before the
    rotation (``src``: the buffers it reads), by trig from ``_rotation``; sign -1 rotates back."""
    @T.macro
    def rotate_pairs(src, OUT, trig, i, h):
        for p in range(half):
            OUT[i, h, nope + 2 * p] = value(src, i, h, nope + 2 * p) * trig[p, 0] - \
                value(src, i, h, nope + 2 * p + 1) * (trig[p, 1] * T.float32(sign))
            OUT[i, h, nope + 2 * p + 1] = value(src, i, h, nope + 2 * p + 1) * trig[p, 0] + \
                value(src, i, h, nope + 2 * p) * (trig[p, 1] * T.float32(sign))
    return rotate_pairs


def rope(heads: int, dim: int, rope_dim: int, inverse: bool):
    """GPT-J rotation of the trailing rope_dim channels of x [N, heads, dim] at positions [N], in
    parallel over (token, block of heads)."""
    half = rope_dim // 2
    nope = dim - rope_dim
    sign = -1.0 if inverse else 1.0
    hb = math.gcd(heads, ROPE_HEAD_BLOCK)
    rotation = _rotation(half)
    rotate_pairs = _pair_rotation(half, nope, lambda src, i, h, j: src[0][i, h, j], sign)

    @T.macro
    def rotate(X, OUT, trig, i, h):  # token i's head h
        for j in range(nope):
            OUT[i, h, j] = X[i, h, j]
        rotate_pairs((X,), OUT, trig, i, h)

    @T.prim_func
    def f(x: T.handle, pos: T.handle, inv: T.handle, out: T.handle):
        n = T.int32()
        X = T.match_buffer(x, (n, heads, dim), F32)
        POS = T.match_buffer(pos, (n,), "int32")
        INV = T.match_buffer(inv, (half,), F32)
        OUT = T.match_buffer(out, (n, heads, dim), F32)
        for ib in T.parallel(n * (heads // hb)):
            trig = T.alloc_buffer((half, 2), F32, scope="local", annotations=ON_STACK)
            rotation(POS, INV, _job_token(ib, heads, hb), trig)
            for hh in range(hb):
                rotate(X, OUT, trig, _job_token(ib, heads, hb), _job_head(ib, heads, hb, hh))
    return f


def rmsnorm_rope(heads: int, dim: int, rope_dim: int, eps: float, weighted: bool, *, max_lanes: int = 0):
    """rmsnorm over each head's ``dim`` channels (times w when weighted), then the GPT-J rotation
    of the trailing ``rope_dim`` channels at the token's position; in parallel over (token,
    block of heads). On the CPU the sum of squares runs in vector lanes (each lane in channel
    order, the lanes added last) and the scaling in vectors; GPU builds (``max_lanes``) sum in
    one lane."""
    half = rope_dim // 2
    nope = dim - rope_dim
    hb = math.gcd(heads, ROPE_HEAD_BLOCK)
    rotation = _rotation(half)
    lanes = 1 if max_lanes else math.gcd(dim, cpu_vector()[0])
    columns = T.serial if max_lanes else T.vectorized

    def normed(X, W, acc, i, h, j):
        return X[i, h, j] * acc[0] * T.if_then_else(weighted, W[j], T.float32(1))

    rotate_pairs = _pair_rotation(half, nope, lambda src, i, h, j: normed(*src, i, h, j))

    @T.macro
    def normalize(X, W, OUT, acc, part, trig, i, h):
        for l in columns(lanes):
            part[l] = T.float32(0)
        for jj in range(dim // lanes):
            for l in columns(lanes):
                part[l] = part[l] + X[i, h, jj * lanes + l] * X[i, h, jj * lanes + l]
        acc[0] = T.float32(0)
        for l in range(lanes):
            acc[0] = acc[0] + part[l]
        acc[0] = T.float32(1) / T.sqrt(acc[0] / T.float32(dim) + T.float32(eps))
        for jj in range(nope // lanes):
            for l in columns(lanes):
                OUT[i, h, jj * lanes + l] = normed(X, W, acc, i, h, jj * lanes + l)
        for j in range(nope // lanes * lanes, nope):
            OUT[i, h, j] = normed(X, W, acc, i, h, j)
        rotate_pairs((X, W, acc), OUT, trig, i, h)

    @T.prim_func
    def f(x: T.handle, w: T.handle, pos: T.handle, inv: T.handle, out: T.handle):
        n = T.int32()
        X = T.match_buffer(x, (n, heads, dim), F32)
        W = T.match_buffer(w, (dim,), F32)
        POS = T.match_buffer(pos, (n,), "int32")
        INV = T.match_buffer(inv, (half,), F32)
        OUT = T.match_buffer(out, (n, heads, dim), F32)
        for ib in T.parallel(n * (heads // hb)):
            acc = T.alloc_buffer((1,), F32, scope="local", annotations=ON_STACK)
            part = T.alloc_buffer((lanes,), F32, scope="local", annotations=ON_STACK)
            trig = T.alloc_buffer((half, 2), F32, scope="local", annotations=ON_STACK)
            rotation(POS, INV, _job_token(ib, heads, hb), trig)
            for hh in range(hb):
                normalize(X, W, OUT, acc, part, trig, _job_token(ib, heads, hb), _job_head(ib, heads, hb, hh))
    return f


def add(dim: int):
    @T.prim_func
    def f(a: T.handle, b: T.handle, out: T.handle):
        n = T.int32()
        A = T.match_buffer(a, (n, dim), F32)
        B = T.match_buffer(b, (n, dim), F32)
        OUT = T.match_buffer(out, (n, dim), F32)
        for i in T.parallel(n):
            for j in range(dim):
                OUT[i, j] = A[i, j] + B[i, j]
    return f


def concat_columns(left: int, right: int):
    """out[i] = a[i] followed by b[i]: two [n, .] matrices side by side (``concat`` of more
    inputs takes them one at a time). In parallel over every output value (a GPU thread each)."""
    width = left + right

    @T.prim_func
    def f(a: T.handle, b: T.handle, out: T.handle):
        n = T.int32()
        A = T.match_buffer(a, (n, left), F32)
        B = T.match_buffer(b, (n, right), F32)
        OUT = T.match_buffer(out, (n, width), F32)
        for i in T.parallel(n * width):
            if i % width < left:
                OUT[i // width, i % width] = A[i // width, i % width]
            else:
                OUT[i // width, i % width] = B[i // width, i % width - left]
    return f
