"""The KV compressor: its ring of open windows, and the gated pooling of closed windows."""

from __future__ import annotations

from tvm.script import tirx as T

from dsv4c.codegen.kernels.codecs import F32, NEG_INF
from dsv4c.codegen.kernels.cpu import ON_STACK


def _compressor_source(width: int, ratio: int):
    """Reads (kv, score) of a compressor source row: ``src >= 0`` is a row of this step (its
    score is the gate plus ``ape[pos % ratio]``), ``src < 0`` is ring row ``-src - 1`` (stored
    with its ape already added)."""
    @T.macro
    def read(RKV, RSC, KV, GATE, POS, APE, src, col, kv_out, score_out, slot):
        if src >= 0:
            kv_out[slot] = KV[src, col]
            score_out[slot] = GATE[src, col] + APE[POS[src] % ratio, col]
        else:
            kv_out[slot] = RKV[-src - 1, col]
            score_out[slot] = RSC[-src - 1, col]
    return read


def ring_reset(width: int, ring_rows: int):
    """Empties the ring of every request that starts at position 0 in this step (kv 0, score
    -inf: zero weight in pooling), whatever an earlier request left in its slot; runs before
    the step's pooling reads the ring (window -1 of overlapping windows reads it)."""
    @T.prim_func
    def f(ring_kv: T.handle, ring_sc: T.handle, req: T.handle):
        r = T.int32()
        nr = T.int32()
        RKV = T.match_buffer(ring_kv, (r, width), F32)
        RSC = T.match_buffer(ring_sc, (r, width), F32)
        REQ = T.match_buffer(req, (nr, 4), "int32")  # slot, first token, count, first position
        for q in T.parallel(nr):
            if REQ[q, 3] == 0:
                for i in range(ring_rows):
                    for c in range(width):
                        RKV[REQ[q, 0] * ring_rows + i, c] = T.float32(0)
                        RSC[REQ[q, 0] * ring_rows + i, c] = T.float32(NEG_INF)
    return f


def ring_update(width: int, ratio: int, overlap: bool):
    """The compressor ring after this step's closed windows were pooled from it: per request,
    each of its last ``slots`` positions p of the step goes to ring row p mod slots (slots =
    2 ratio with overlap: the previous window and the open one; else ratio). Every position
    owns its row, so what a step writes depends only on the positions it feeds, never on how
    the tokens were chunked, and taking a token back (speculative decoding) restores its rows
    alone (``runtime.kv_pool.KVPool.position_rows``)."""
    read = _compressor_source(width, ratio)
    slots = 2 * ratio if overlap else ratio

    def skipped(REQ, q):  # request q's positions in the step beyond the ring's last ``slots``
        return T.max(REQ[q, 2] - slots, 0)

    def ring_row(REQ, q, i):  # the ring row of request q's i-th position after the skipped ones
        return REQ[q, 0] * slots + T.floormod(REQ[q, 3] + skipped(REQ, q) + i, slots)

    @T.prim_func
    def f(ring_kv: T.handle, ring_sc: T.handle, kv: T.handle, gate: T.handle, pos: T.handle, ape: T.handle,
          req: T.handle):
        r = T.int32()
        n = T.int32()
        nr = T.int32()
        RKV = T.match_buffer(ring_kv, (r, width), F32)
        RSC = T.match_buffer(ring_sc, (r, width), F32)
        KV = T.match_buffer(kv, (n, width), F32)
        GATE = T.match_buffer(gate, (n, width), F32)
        POS = T.match_buffer(pos, (n,), "int32")
        APE = T.match_buffer(ape, (ratio, width), F32)
        REQ = T.match_buffer(req, (nr, 4), "int32")  # slot, first token, count, first position
        for q in T.parallel(nr):
            kv_val = T.alloc_buffer((1,), F32, scope="local", annotations=ON_STACK)
            score_val = T.alloc_buffer((1,), F32, scope="local", annotations=ON_STACK)
            # The first skipped(q) positions are overwritten by later ones of this step.
            for i in range(REQ[q, 2] - skipped(REQ, q)):
                for c in range(width):
                    read(RKV, RSC, KV, GATE, POS, APE, REQ[q, 1] + skipped(REQ, q) + i, c, kv_val, score_val, 0)
                    RKV[ring_row(REQ, q, i), c] = kv_val[0]
                    RSC[ring_row(REQ, q, i), c] = score_val[0]
    return f


def compress_pool(width: int, head_dim: int, ratio: int, overlap: bool, weights_first: bool = False):
    """Gated pooling of closed windows: out[w, c] = sum_s softmax_s(score)[c] * kv[c] over the
    window's slots src[w, s] (step row if >= 0, ring row -src-1 otherwise), for the windows
    whose entry has a pool row (``rows[w] >= 0``; the others are zero and cost nothing). With
    overlap the first ``ratio`` slots read the first half of the columns, the rest the second half.

    In parallel over (window, column), the slots read twice (their max, then the weighted sums)
    rather than held: a GPU thread per (window, column) keeps nothing but scalars (holding the
    128 slots of an HCA window took 1 KiB of local memory per thread).

    ``weights_first`` sums each slot's value times its normalised weight, in a third pass (V4.1's
    reference order, ``reference_v41._gated_pool``: a round trip follows, where one ulp can
    cross a rounding midpoint); otherwise the weighted sum is divided by the denominator once."""
    slots = 2 * ratio if overlap else ratio
    read = _compressor_source(width, ratio)

    def column(s, c):  # the source column slot s reads for output column c
        return T.if_then_else(overlap and s >= ratio, c + head_dim, c)

    @T.prim_func
    def f(ring_kv: T.handle, ring_sc: T.handle, kv: T.handle, gate: T.handle, pos: T.handle, ape: T.handle,
          src: T.handle, rows: T.handle, out: T.handle):
        r = T.int32()
        n = T.int32()
        nw = T.int32()
        RKV = T.match_buffer(ring_kv, (r, width), F32)
        RSC = T.match_buffer(ring_sc, (r, width), F32)
        KV = T.match_buffer(kv, (n, width), F32)
        GATE = T.match_buffer(gate, (n, width), F32)
        POS = T.match_buffer(pos, (n,), "int32")
        APE = T.match_buffer(ape, (ratio, width), F32)
        SRC = T.match_buffer(src, (nw, slots), "int32")
        ROWS = T.match_buffer(rows, (nw,), "int32")
        OUT = T.match_buffer(out, (nw, head_dim), F32)
        for i in T.parallel(nw * head_dim):  # (window, column)
            val = T.alloc_buffer((1,), F32, scope="local", annotations=ON_STACK)
            sc = T.alloc_buffer((1,), F32, scope="local", annotations=ON_STACK)
            acc = T.alloc_buffer((3,), F32, scope="local", annotations=ON_STACK)  # max, denominator, sum
            if ROWS[i // head_dim] < 0:  # a window slot this step does not close: nothing to pool
                OUT[i // head_dim, i % head_dim] = T.float32(0)
            else:
                acc[0] = T.float32(NEG_INF)
                for s in range(slots):
                    read(RKV, RSC, KV, GATE, POS, APE, SRC[i // head_dim, s], column(s, i % head_dim), val, sc, 0)
                    acc[0] = T.max(acc[0], sc[0])
                acc[1] = T.float32(0)
                acc[2] = T.float32(0)
                for s in range(slots):
                    read(RKV, RSC, KV, GATE, POS, APE, SRC[i // head_dim, s], column(s, i % head_dim), val, sc, 0)
                    acc[1] = acc[1] + T.exp(sc[0] - acc[0])
                    if not weights_first:
                        acc[2] = acc[2] + T.exp(sc[0] - acc[0]) * val[0]
                if weights_first:
                    for s in range(slots):
                        read(RKV, RSC, KV, GATE, POS, APE, SRC[i // head_dim, s], column(s, i % head_dim), val, sc, 0)
                        acc[2] = acc[2] + val[0] * (T.exp(sc[0] - acc[0]) / acc[1])
                    OUT[i // head_dim, i % head_dim] = acc[2]
                else:
                    OUT[i // head_dim, i % head_dim] = acc[2] / acc[1]
    return f
