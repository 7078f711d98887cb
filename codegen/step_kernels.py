"""Bookkeeping kernels of the compiled step: the row arithmetic the host used to do.

A step receives only what the host knows in O(tokens + requests) integers (see
``relax_step.StepInputs``): every token's position and request, and per request its pool slot,
its first token in the step, its token count, its first position and its block table. From
those, the kernels below compute on the device which pool rows a token's window writes, which
compressor windows close and where their entries go, the rows index scoring and sparse
attention read, and how routed tokens group by expert. No host round trip happens inside a
step, so they run wherever the step runs (the CPU, or one GPU thread per row).

Conventions shared with the kernels of ``codegen.kernels``:
* a "source" row of a compressor is ``>= 0`` for a row of this step, ``-row - 1`` for ring row
  ``row``;
* an attention row ``>= pool_rows`` is row ``row - pool_rows`` of this step's fresh KV;
* ``-1`` everywhere means "no row": stores skip it, readers skip it.

Per-request columns of ``req`` (int32 [R, 4]): slot, first token, token count, first position.
Per-layer numbers the kernels share across layers (window ring of layer ``l``, envelope offset
of a layer's rows) arrive as int64 scalars.
"""

from __future__ import annotations

from tvm.script import tirx as T

from dsv4c.codegen.kernels.cpu import ON_STACK
from dsv4c.artifact.pool import ENVELOPE_TOKENS

REQ_SLOT, REQ_FIRST_TOKEN, REQ_COUNT, REQ_FIRST_POS = range(4)
REQ_COLUMNS = 4


# Named values of a request, written into the kernels' expressions: TVM would give a named index
# (``q = ...``) a workspace allocation per parallel job.
def last_position(REQ, q):
    """Request q's last position in the step."""
    return REQ[q, REQ_FIRST_POS] + REQ[q, REQ_COUNT] - 1


def window_ring_row(REQ, q, pool_rows, window: int, window_rows_per_request: int, layer, p):
    """The pool row of position p in layer ``layer``'s window ring of request q's slot (slots grow
    down from the pool's end, a ring of ``window`` rows per layer)."""
    return T.Cast("int32", pool_rows) - (REQ[q, REQ_SLOT] + 1) * window_rows_per_request + \
        T.Cast("int32", layer) * window + T.floormod(p, window)


def window_rows(window: int, window_rows_per_request: int):
    """Pool row of every token whose window row this step keeps, else -1: the last ``window``
    tokens of each request in the step (a longer chunk's earlier rows would be overwritten in
    the ring anyway), at row ``slot base + layer * window + pos % window``."""
    @T.prim_func
    def f(pos: T.handle, tok_req: T.handle, req: T.handle, layer: T.int64, pool_rows: T.int64, rows: T.handle):
        n = T.int32()
        nr = T.int32()
        POS = T.match_buffer(pos, (n,), "int32")
        TOK_REQ = T.match_buffer(tok_req, (n,), "int32")
        REQ = T.match_buffer(req, (nr, REQ_COLUMNS), "int32")
        ROWS = T.match_buffer(rows, (n,), "int32")
        for t in T.parallel(n):
            ROWS[t] = T.if_then_else(POS[t] > last_position(REQ, TOK_REQ[t]) - window,
                                     window_ring_row(REQ, TOK_REQ[t], pool_rows, window, window_rows_per_request,
                                                     layer, POS[t]), -1)
    return f


def compress_windows(ratio: int, overlap: bool):
    """The compressor windows this step closes, request by request in step order, ascending:
    per window its source rows ``src`` (the ``ratio`` tokens of the window, after the ``ratio``
    tokens of the previous window when windows overlap), the position of its entry (window *
    ratio, the position the compress rope uses) and the pool row the entry goes to (-1 for the
    unused tail of the ``nw`` slots, an upper bound of R + T // ratio).

    A request's ring holds its last ``2 ratio`` (overlap) or ``ratio`` positions, position p
    at row p mod that (``kernels.compressor.ring_update``): a position before the request's first
    position in this step is read there. Window -1 (before position 0) reads rows that
    ``ring_reset`` emptied (scores -inf: zero weight)."""
    slots = 2 * ratio if overlap else ratio
    cur = ratio if overlap else 0
    entries_per_envelope = ENVELOPE_TOKENS // ratio

    @T.macro
    def source(POS0, FIRST, base, p, out, w, s):
        # A step row when the position is in this step, its ring row otherwise.
        out[w, s] = T.if_then_else(p >= POS0, FIRST + (p - POS0), -(base + T.floormod(p, slots)) - 1)

    def first_window(REQ, q):  # the window request q's first position in the step lies in
        return T.floordiv(REQ[q, REQ_FIRST_POS], ratio)

    def closed(REQ, q):  # windows request q closes in this step
        return T.floordiv(REQ[q, REQ_FIRST_POS] + REQ[q, REQ_COUNT], ratio) - first_window(REQ, q)

    @T.macro
    def window(REQ, BLOCKS, SRC, ENTRY_POS, ENTRY_ROWS, rows_per_envelope, layer_offset, i, q, w):
        """Slot i: request q's window w."""
        for j in range(ratio):
            if overlap:
                source(REQ[q, REQ_FIRST_POS], REQ[q, REQ_FIRST_TOKEN], REQ[q, REQ_SLOT] * slots, (w - 1) * ratio + j,
                       SRC, i, j)
            source(REQ[q, REQ_FIRST_POS], REQ[q, REQ_FIRST_TOKEN], REQ[q, REQ_SLOT] * slots, w * ratio + j, SRC, i,
                   cur + j)
        ENTRY_POS[i] = w * ratio
        ENTRY_ROWS[i] = BLOCKS[q, T.floordiv(w, entries_per_envelope)] * T.Cast("int32", rows_per_envelope) + \
            T.Cast("int32", layer_offset) + T.floormod(w, entries_per_envelope)

    @T.prim_func
    def f(req: T.handle, blocks: T.handle, rows_per_envelope: T.int64, layer_offset: T.int64, src: T.handle,
          entry_pos: T.handle, entry_rows: T.handle):
        nr = T.int32()
        nb = T.int32()
        nw = T.int32()
        REQ = T.match_buffer(req, (nr, REQ_COLUMNS), "int32")
        BLOCKS = T.match_buffer(blocks, (nr, nb), "int32")
        SRC = T.match_buffer(src, (nw, slots), "int32")
        ENTRY_POS = T.match_buffer(entry_pos, (nw,), "int32")
        ENTRY_ROWS = T.match_buffer(entry_rows, (nw,), "int32")
        for i in T.parallel(nw):
            found = T.alloc_buffer((2,), "int32", scope="local", annotations=ON_STACK)  # request, its first window
            seen = T.alloc_buffer((1,), "int32", scope="local", annotations=ON_STACK)
            found[0] = -1
            seen[0] = 0
            for q in range(nr):
                if found[0] < 0 and i < seen[0] + closed(REQ, q):
                    found[0] = q
                    found[1] = first_window(REQ, q) + i - seen[0]
                seen[0] = seen[0] + closed(REQ, q)
            if found[0] < 0:
                ENTRY_ROWS[i] = -1
                ENTRY_POS[i] = 0
                for s in range(slots):
                    SRC[i, s] = -1
            else:
                window(REQ, BLOCKS, SRC, ENTRY_POS, ENTRY_ROWS, rows_per_envelope, layer_offset, i, found[0], found[1])
    return f


def entry_rows(ratio: int):
    """rows[t, e]: the pool row of compressed entry e of token t's request while the entry is
    visible to t (e < (pos + 1) // ratio), else -1; e runs over the step's widest visibility."""
    entries_per_envelope = ENVELOPE_TOKENS // ratio
    @T.prim_func
    def f(pos: T.handle, tok_req: T.handle, blocks: T.handle, rows_per_envelope: T.int64, layer_offset: T.int64,
          rows: T.handle):
        n = T.int32()
        nr = T.int32()
        nb = T.int32()
        ne = T.int32()
        POS = T.match_buffer(pos, (n,), "int32")
        TOK_REQ = T.match_buffer(tok_req, (n,), "int32")
        BLOCKS = T.match_buffer(blocks, (nr, nb), "int32")
        ROWS = T.match_buffer(rows, (n, ne), "int32")
        for t in T.parallel(n):
            for e in range(ne):
                ROWS[t, e] = T.if_then_else(
                    e < T.floordiv(POS[t] + 1, ratio),
                    BLOCKS[TOK_REQ[t], T.floordiv(e, entries_per_envelope)] *
                    T.Cast("int32", rows_per_envelope) + T.Cast("int32", layer_offset) +
                    T.floormod(e, entries_per_envelope), -1)
    return f


def attention_rows(window: int, window_rows_per_request: int, ratio: int, compressed: str):
    """Per query, the rows sparse attention reads, in the order it sums them: its window
    (positions pos - window + 1 .. pos; this step's fresh rows for positions in the step, the
    request's window ring for older ones, -1 before position 0), then its compressed rows:
    none (``compressed == "none"``), every visible entry (``"all"``, HCA) or the index top-k
    entries (``"topk"``, CSA; -1 entries stay -1)."""
    entries_per_envelope = ENVELOPE_TOKENS // ratio if ratio else 1

    def entry_row(BLOCKS, q, e, rows_per_envelope, layer_offset):
        return BLOCKS[q, T.floordiv(e, entries_per_envelope)] * T.Cast("int32", rows_per_envelope) + \
            T.Cast("int32", layer_offset) + T.floormod(e, entries_per_envelope)

    @T.macro
    def window_row(REQ, ROWS, layer, pool_rows, t, j, q, p):  # slot j of token t (request q): position p
        ROWS[t, j] = T.if_then_else(
            p < 0, -1, T.if_then_else(p >= REQ[q, REQ_FIRST_POS], T.Cast("int32", pool_rows) + t - (window - 1 - j),
                                      window_ring_row(REQ, q, pool_rows, window, window_rows_per_request, layer, p)))

    @T.macro
    def window_part(POS, TOK_REQ, REQ, ROWS, layer, pool_rows, t):
        for j in range(window):
            window_row(REQ, ROWS, layer, pool_rows, t, j, TOK_REQ[t], POS[t] - (window - 1) + j)

    if compressed == "topk":
        @T.prim_func
        def f(pos: T.handle, tok_req: T.handle, req: T.handle, blocks: T.handle, topk: T.handle, layer: T.int64,
              pool_rows: T.int64, rows_per_envelope: T.int64, layer_offset: T.int64, rows: T.handle):
            n = T.int32()
            nr = T.int32()
            nb = T.int32()
            k = T.int32()
            POS = T.match_buffer(pos, (n,), "int32")
            TOK_REQ = T.match_buffer(tok_req, (n,), "int32")
            REQ = T.match_buffer(req, (nr, REQ_COLUMNS), "int32")
            BLOCKS = T.match_buffer(blocks, (nr, nb), "int32")
            TOPK = T.match_buffer(topk, (n, k), "int32")
            ROWS = T.match_buffer(rows, (n, window + k), "int32")
            for t in T.parallel(n):
                window_part(POS, TOK_REQ, REQ, ROWS, layer, pool_rows, t)
                for j in range(k):
                    ROWS[t, window + j] = T.if_then_else(
                        TOPK[t, j] < 0, -1, entry_row(BLOCKS, TOK_REQ[t], T.max(TOPK[t, j], 0), rows_per_envelope,
                                                      layer_offset))
        return f
    if compressed == "all":
        @T.prim_func
        def f(pos: T.handle, tok_req: T.handle, req: T.handle, blocks: T.handle, layer: T.int64, pool_rows: T.int64,
              rows_per_envelope: T.int64, layer_offset: T.int64, rows: T.handle):
            n = T.int32()
            nr = T.int32()
            nb = T.int32()
            m = T.int32()
            POS = T.match_buffer(pos, (n,), "int32")
            TOK_REQ = T.match_buffer(tok_req, (n,), "int32")
            REQ = T.match_buffer(req, (nr, REQ_COLUMNS), "int32")
            BLOCKS = T.match_buffer(blocks, (nr, nb), "int32")
            ROWS = T.match_buffer(rows, (n, m), "int32")
            for t in T.parallel(n):
                window_part(POS, TOK_REQ, REQ, ROWS, layer, pool_rows, t)
                for e in range(m - window):
                    ROWS[t, window + e] = T.if_then_else(
                        e < T.floordiv(POS[t] + 1, ratio),
                        entry_row(BLOCKS, TOK_REQ[t], e, rows_per_envelope, layer_offset), -1)
        return f

    @T.prim_func
    def f(pos: T.handle, tok_req: T.handle, req: T.handle, layer: T.int64, pool_rows: T.int64, rows: T.handle):
        n = T.int32()
        nr = T.int32()
        POS = T.match_buffer(pos, (n,), "int32")
        TOK_REQ = T.match_buffer(tok_req, (n,), "int32")
        REQ = T.match_buffer(req, (nr, REQ_COLUMNS), "int32")
        ROWS = T.match_buffer(rows, (n, window), "int32")
        for t in T.parallel(n):
            window_part(POS, TOK_REQ, REQ, ROWS, layer, pool_rows, t)
    return f


def block_attention_rows(window: int, window_rows_per_request: int):
    """Per query of a draft block (``sparse_attn`` kind ``block``), the rows it reads: its
    request's window ring for the ``window`` positions before the request's first position in
    the call (ascending; -1 before position 0), then every one of the request's rows of this call
    in call order (no causal mask inside a block), -1 up to the call's token count ``n``: every
    query of a request reads the same list. The ring is read, never written: the target step
    writes it."""
    @T.prim_func
    def f(tok_req: T.handle, req: T.handle, layer: T.int64, pool_rows: T.int64, rows: T.handle):
        n = T.int32()
        nr = T.int32()
        TOK_REQ = T.match_buffer(tok_req, (n,), "int32")
        REQ = T.match_buffer(req, (nr, REQ_COLUMNS), "int32")
        ROWS = T.match_buffer(rows, (n, window + n), "int32")
        for t in T.parallel(n):
            for j in range(window):
                ROWS[t, j] = T.if_then_else(
                    REQ[TOK_REQ[t], REQ_FIRST_POS] - window + j < 0, -1,
                    window_ring_row(REQ, TOK_REQ[t], pool_rows, window, window_rows_per_request, layer,
                                    REQ[TOK_REQ[t], REQ_FIRST_POS] - window + j))
            for j in range(n):
                ROWS[t, window + j] = T.if_then_else(
                    j < REQ[TOK_REQ[t], REQ_COUNT], T.Cast("int32", pool_rows) + REQ[TOK_REQ[t], REQ_FIRST_TOKEN] + j,
                    -1)
    return f


def moe_group(k: int, n_experts: int):
    """Routed (token, slot) pairs grouped by expert: ``offsets[e]`` .. ``offsets[e + 1]`` are
    expert e's pairs, in token order; ``pair_token[p]`` is pair p's token and ``token_pair[t,
    j]`` the pair of token t's slot j. An id of -1 is an expert another rank holds
    (``shard_ids``, expert parallel): its pairs follow ``offsets[n_experts]``, where no expert
    computes them, and their ``token_pair`` is -1. A counting sort, in order on one thread (it
    is O(pairs + experts) integer work)."""
    @T.prim_func
    def f(ids: T.handle, offsets: T.handle, pair_token: T.handle, token_pair: T.handle):
        n = T.int32()
        IDS = T.match_buffer(ids, (n, k), "int32")
        OFFSETS = T.match_buffer(offsets, (n_experts + 1,), "int32")
        PAIR_TOKEN = T.match_buffer(pair_token, (n * k,), "int32")
        TOKEN_PAIR = T.match_buffer(token_pair, (n, k), "int32")
        filled = T.alloc_buffer((n_experts,), "int32", scope="local", annotations=ON_STACK)
        foreign = T.alloc_buffer((1,), "int32", scope="local", annotations=ON_STACK)
        for e in range(n_experts + 1):
            OFFSETS[e] = 0
        for t in range(n):
            for j in range(k):
                if IDS[t, j] >= 0:
                    OFFSETS[IDS[t, j] + 1] = OFFSETS[IDS[t, j] + 1] + 1
        for e in range(n_experts):
            OFFSETS[e + 1] = OFFSETS[e + 1] + OFFSETS[e]
            filled[e] = 0
        foreign[0] = 0
        for t in range(n):
            for j in range(k):
                if IDS[t, j] >= 0:
                    PAIR_TOKEN[OFFSETS[IDS[t, j]] + filled[IDS[t, j]]] = t
                    TOKEN_PAIR[t, j] = OFFSETS[IDS[t, j]] + filled[IDS[t, j]]
                    filled[IDS[t, j]] = filled[IDS[t, j]] + 1
                else:
                    PAIR_TOKEN[OFFSETS[n_experts] + foreign[0]] = t
                    TOKEN_PAIR[t, j] = -1
                    foreign[0] = foreign[0] + 1
    return f


def moe_combine(dim: int, k: int):
    """out[t] = sum of weight[t, j] * down[token_pair[t, j]] over t's slots in ascending pair
    order, i.e. ascending expert id (pairs are grouped by expert), the order the reference
    adds experts in; so a token's sum does not depend on the batch it ran in. Slots of -1
    (another rank's experts) add nothing."""
    @T.prim_func
    def f(down: T.handle, token_pair: T.handle, weights: T.handle, out: T.handle):
        n = T.int32()
        p = T.int32()
        DOWN = T.match_buffer(down, (p, dim), "float32")
        TOKEN_PAIR = T.match_buffer(token_pair, (n, k), "int32")
        W = T.match_buffer(weights, (n, k), "float32")
        OUT = T.match_buffer(out, (n, dim), "float32")
        for t in T.parallel(n):
            order = T.alloc_buffer((k,), "int32", scope="local", annotations=ON_STACK)
            tmp = T.alloc_buffer((1,), "int32", scope="local", annotations=ON_STACK)
            for j in range(k):  # insertion sort of the slots by pair number
                order[j] = j
                for i in range(j):
                    if TOKEN_PAIR[t, order[j - i]] < TOKEN_PAIR[t, order[j - i - 1]]:
                        tmp[0] = order[j - i]
                        order[j - i] = order[j - i - 1]
                        order[j - i - 1] = tmp[0]
            for d in range(dim):
                OUT[t, d] = T.float32(0)
            for j in range(k):
                if TOKEN_PAIR[t, order[j]] >= 0:
                    for d in range(dim):
                        OUT[t, d] = OUT[t, d] + DOWN[TOKEN_PAIR[t, order[j]], d] * W[t, order[j]]
    return f


def shard_ids(size: int):
    """out = ids - first where that lies in [0, size), else -1: global vocab rows or expert ids
    as one rank's (tensor parallel; ``first`` is the rank's first, a [1] tensor of its weights)."""
    @T.prim_func
    def f(ids: T.handle, first: T.handle, out: T.handle):
        n = T.int32()
        w = T.int32()
        IDS = T.match_buffer(ids, (n, w), "int32")
        FIRST = T.match_buffer(first, (1,), "int32")
        OUT = T.match_buffer(out, (n, w), "int32")
        for i in T.parallel(n):
            for j in range(w):
                OUT[i, j] = T.if_then_else((IDS[i, j] >= FIRST[0]) & (IDS[i, j] < FIRST[0] + size),
                                           IDS[i, j] - FIRST[0], -1)
    return f


def gather_rows(dtype: str = "float32"):
    """out[i] = x[idx[i]]: the rows a step reads back (logits) or routes (expert pairs), and the
    pool rows speculative decoding saves (``relax_step.emit_pool_functions``: any pool dtype). A row
    of -1 reads row 0: the pool's row lists pad an empty list with -1, which ``scatter_rows``
    then skips."""
    @T.prim_func
    def f(x: T.handle, idx: T.handle, out: T.handle):
        n = T.int32()
        m = T.int32()
        d = T.int32()
        X = T.match_buffer(x, (n, d), dtype)
        IDX = T.match_buffer(idx, (m,), "int32")
        OUT = T.match_buffer(out, (m, d), dtype)
        for i in T.parallel(m):
            for j in range(d):
                OUT[i, j] = X[T.max(IDX[i], 0), j]
    return f


def scatter_rows(dtype: str = "float32"):
    """x[idx[i]] = rows[i] in place, skipping rows of -1: saved pool rows put back."""
    @T.prim_func
    def f(x: T.handle, idx: T.handle, rows: T.handle):
        n = T.int32()
        m = T.int32()
        d = T.int32()
        X = T.match_buffer(x, (n, d), dtype)
        IDX = T.match_buffer(idx, (m,), "int32")
        ROWS = T.match_buffer(rows, (m, d), dtype)
        for i in T.parallel(m):
            if IDX[i] >= 0:
                for j in range(d):
                    X[IDX[i], j] = ROWS[i, j]
    return f


def pad_rows():
    """x [n, g, d] as out [g, m, d], each group's n rows first and zeros below: the GEMM kernels
    run on whole blocks of rows, and a grouped GEMM's on its groups one after another (see
    kernels.matmul.linear)."""
    @T.prim_func
    def f(x: T.handle, out: T.handle):
        n = T.int32()
        m = T.int32()
        g = T.int32()
        d = T.int32()
        X = T.match_buffer(x, (n, g, d), "float32")
        OUT = T.match_buffer(out, (g, m, d), "float32")
        for i in T.parallel(g * m):
            for j in range(d):
                OUT[i // m, i % m, j] = T.if_then_else(i % m < n, X[T.min(i % m, n - 1), i // m, j], T.float32(0))
    return f


def copy_rows(dtype: str):
    """out = x: a decode step's inputs copied into buffers of the step's own (int32), and its
    outputs out of them (float32): a CUDA graph replays its kernels on the addresses it was
    captured with, and the caller's inputs and the step's outputs are new tensors every step."""
    @T.prim_func
    def f(x: T.handle, out: T.handle):
        n = T.int32()
        w = T.int32()
        X = T.match_buffer(x, (n, w), dtype)
        OUT = T.match_buffer(out, (n, w), dtype)
        for i in T.parallel(n):
            for j in range(w):
                OUT[i, j] = X[i, j]
    return f


def slice_columns():
    """out[:, j] = x[:, start + j]: one output of a merged projection."""
    @T.prim_func
    def f(x: T.handle, start: T.int64, out: T.handle):
        n = T.int32()
        d = T.int32()
        w = T.int32()
        X = T.match_buffer(x, (n, d), "float32")
        OUT = T.match_buffer(out, (n, w), "float32")
        for i in T.parallel(n):
            for j in range(w):
                OUT[i, j] = X[i, T.Cast("int32", start) + j]
    return f
