"""Mixture-of-experts kernels besides the matmuls: the router's scores and bias (V4.1's image
bias too), hash routing,
the chosen experts' weights, and the experts' SwiGLU activation (top-k: ``kernels.topk``)."""

from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

from dsv4c.codegen.kernels.codecs import F32, vector_exp
from dsv4c.codegen.kernels.cpu import ON_STACK


def route_scores(n_experts: int, temp: float = 1.0):
    """sqrt(softplus(logits / temp)), the router's scores (softplus written overflow-free; V4.1
    divides the logits by its ``gate_temp``, 1 elsewhere: no division)."""
    @T.prim_func
    def f(lg: T.handle, out: T.handle):
        n = T.int32()
        LG = T.match_buffer(lg, (n, n_experts), F32)
        OUT = T.match_buffer(out, (n, n_experts), F32)
        for t in T.parallel(n):
            for e in range(n_experts):
                OUT[t, e] = T.sqrt(T.max(_tempered(LG[t, e], temp), T.float32(0)) +
                                   T.log(T.float32(1) + T.exp(-T.fabs(_tempered(LG[t, e], temp)))))
    return f


def _tempered(logit, temp: float):
    return logit if temp == 1.0 else logit / tirx.const(temp, F32)


def add_bias(n_experts: int):
    @T.prim_func
    def f(x: T.handle, b: T.handle, out: T.handle):
        n = T.int32()
        X = T.match_buffer(x, (n, n_experts), F32)
        B = T.match_buffer(b, (n_experts,), F32)
        OUT = T.match_buffer(out, (n, n_experts), F32)
        for t in T.parallel(n):
            for e in range(n_experts):
                OUT[t, e] = X[t, e] + B[e]
    return f


def add_image_bias(n_experts: int):
    """``add_bias`` with V4.1's image bias: a token with ``image_index >= 0`` (an image span's)
    adds ``bias_vl`` instead of ``bias``."""
    @T.prim_func
    def f(x: T.handle, b: T.handle, b_vl: T.handle, image: T.handle, out: T.handle):
        n = T.int32()
        X = T.match_buffer(x, (n, n_experts), F32)
        B = T.match_buffer(b, (n_experts,), F32)
        B_VL = T.match_buffer(b_vl, (n_experts,), F32)
        IMAGE = T.match_buffer(image, (n,), "int32")
        OUT = T.match_buffer(out, (n, n_experts), F32)
        for t in T.parallel(n):
            for e in range(n_experts):
                OUT[t, e] = X[t, e] + T.if_then_else(IMAGE[t] >= 0, B_VL[e], B[e])
    return f


def hash_ids(vocab: int, k: int):
    @T.prim_func
    def f(table: T.handle, tok: T.handle, ids: T.handle):
        n = T.int32()
        TABLE = T.match_buffer(table, (vocab, k), "int32")
        TOK = T.match_buffer(tok, (n,), "int32")
        IDS = T.match_buffer(ids, (n, k), "int32")
        for t in T.parallel(n):
            for j in range(k):
                IDS[t, j] = TABLE[TOK[t], j]
    return f


def route_weights(n_experts: int, k: int, scale: float):
    @T.prim_func
    def f(sc: T.handle, ids: T.handle, w: T.handle):
        n = T.int32()
        SC = T.match_buffer(sc, (n, n_experts), F32)
        IDS = T.match_buffer(ids, (n, k), "int32")
        W = T.match_buffer(w, (n, k), F32)
        for t in T.parallel(n):
            acc = T.alloc_buffer((1,), F32, scope="local", annotations=ON_STACK)
            acc[0] = T.float32(0)
            for j in range(k):
                acc[0] = acc[0] + SC[t, IDS[t, j]]
            for j in range(k):
                W[t, j] = SC[t, IDS[t, j]] / (acc[0] + T.float32(1e-20)) * T.float32(scale)
    return f


def swiglu(dim: int, limit: float, *, max_lanes: int = 0):
    """In parallel over (row, block of 256 columns): a decode step's few rows still use every core.
    Vectorized along the columns on the CPU (no Python names inside the loop: a name becomes a
    Let, which TVM's vectorizer evaluates for one lane only); GPU builds (``max_lanes``) loop."""
    cb = math.gcd(dim, 256)
    columns = T.serial if max_lanes else T.vectorized

    def silu_clamped(g):
        return g / (tirx.const(1.0, F32) + vector_exp(-g))

    @T.prim_func
    def f(g: T.handle, u: T.handle, out: T.handle):
        n = T.int32()
        G = T.match_buffer(g, (n, dim), F32)
        U = T.match_buffer(u, (n, dim), F32)
        OUT = T.match_buffer(out, (n, dim), F32)
        for ib in T.parallel(n * (dim // cb)):
            for jj in columns(cb):
                OUT[ib // (dim // cb), ib % (dim // cb) * cb + jj] = silu_clamped(
                    T.min(G[ib // (dim // cb), ib % (dim // cb) * cb + jj], T.float32(limit))) * T.max(
                    T.min(U[ib // (dim // cb), ib % (dim // cb) * cb + jj], T.float32(limit)), T.float32(-limit))
    return f
