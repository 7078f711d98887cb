"""``topk_rows``: the k largest values of each row, by column, without sorting the row."""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from dsv4c.codegen.kernels.codecs import F32, NEG_INF
from dsv4c.codegen.kernels.cpu import ON_STACK


TOPK_LANES = 16  # columns topk_rows compares at a time
INT32_MIN = -(1 << 31)


def order_key(x):
    """An int32 whose signed order is the float order of x, for x above NEG_INF (-0 and +0 one
    key: the sign bit spread over the magnitude bits of negative floats, flipping them); INT32_MIN
    for NEG_INF, -inf and NaN, which are never picked."""
    bits = T.Select(x == T.float32(0), T.int32(0), tirx.reinterpret("int32", x))
    return T.Select(x > T.float32(NEG_INF), bits ^ ((bits >> 31) & T.int32(0x7FFFFFFF)), T.int32(INT32_MIN))


def kth_key_macros(lanes: int):
    """Macros over the order keys (``order_key``) of row t of X [N, C], read ``lanes`` columns
    at a time: ``count_above(X, t, c, lane_count, total, threshold)`` sets total[0] to the number
    of columns whose key is above ``threshold``; ``kth_key(X, t, c, k, threshold, ties)`` sets
    threshold[0] and ties[0] so that the k largest are the columns whose key is above
    threshold[0] and, in column order, the first ties[0] equal to it (all pickable columns where
    there are at most k): a binary search for the k-th largest key in 33 counts, without
    sorting the row."""
    @T.macro
    def lane_sum(lane_count, total):  # total[0]: the lanes' counts added
        total[0] = 0
        for l in range(lanes):
            total[0] = total[0] + lane_count[l]

    @T.macro
    def count_above(X, t, c, lane_count, total, threshold):
        for l in T.vectorized(lanes):
            lane_count[l] = 0
        for co in range((c + lanes - 1) // lanes):
            for l in T.vectorized(lanes):
                lane_count[l] = lane_count[l] + T.Select(T.And(
                    co * lanes + l < c, order_key(X[t, T.min(co * lanes + l, c - 1)]) > threshold), 1, 0)
        lane_sum(lane_count, total)

    @T.macro
    def kth_key(X, t, c, k, threshold, ties):
        lane_count = T.alloc_buffer((lanes,), "int32", scope="local", annotations=ON_STACK)
        total = T.alloc_buffer((1,), "int32", scope="local", annotations=ON_STACK)
        # The largest key below the k-th largest, lo: at least k keys above lo, in [lo, hi].
        lo = T.alloc_buffer((1,), "int64", scope="local", annotations=ON_STACK)
        hi = T.alloc_buffer((1,), "int64", scope="local", annotations=ON_STACK)
        mid = T.alloc_buffer((1,), "int64", scope="local", annotations=ON_STACK)
        lo[0] = T.int64(INT32_MIN)
        hi[0] = T.int64(-INT32_MIN - 2)
        count_above(X, t, c, lane_count, total, T.int32(INT32_MIN))
        if total[0] > k:  # else every pickable column is kept
            for _ in range(32):
                if lo[0] < hi[0]:
                    mid[0] = lo[0] + (hi[0] - lo[0] + 1) // 2
                    count_above(X, t, c, lane_count, total, T.Cast("int32", mid[0]))
                    if total[0] >= k:
                        lo[0] = mid[0]
                    else:
                        hi[0] = mid[0] - 1
        threshold[0] = T.Cast("int32", lo[0] + 1)
        count_above(X, t, c, lane_count, total, threshold[0])
        ties[0] = k - total[0]

    return lane_sum, count_above, kth_key


def topk_rows(k: int):
    """Per row, the column numbers of the k largest values, best first, lower columns first
    among equal values; NEG_INF (and -inf, NaN) columns are never picked (-1 fills the rest).

    In O(columns + k^2 / lanes) vector steps per row, without sorting the row: a binary search
    over order keys (``order_key``) finds the k-th largest, counting the keys above a candidate
    16 at a time (32 counts); one pass keeps the columns above it and, in column order, as many
    equal to it as fit; each kept column's place is the number of kept columns that beat it.
    Same ids as an insertion sort, which cost O(columns x k) scalar steps: 2.7% of a 512-token
    flash prefill at 2048 tokens of context, growing with the context. GPU targets build
    ``kernels.gpu_topk``'s kernel instead: the same algorithm over a block of threads per row."""
    lanes = TOPK_LANES
    kept_lanes = -(-k // lanes) * lanes
    lane_sum, _, kth_key = kth_key_macros(lanes)

    @T.macro
    def select(X, IDS, n, c):
        for t in T.parallel(n):
            threshold = T.alloc_buffer((1,), "int32", scope="local", annotations=ON_STACK)
            ties = T.alloc_buffer((1,), "int32", scope="local", annotations=ON_STACK)
            key = T.alloc_buffer((1,), "int32", scope="local", annotations=ON_STACK)
            kept = T.alloc_buffer((1,), "int32", scope="local", annotations=ON_STACK)
            kept_key = T.alloc_buffer((kept_lanes,), "int32", scope="local", annotations=ON_STACK)
            kept_col = T.alloc_buffer((kept_lanes,), "int32", scope="local", annotations=ON_STACK)
            lane_count = T.alloc_buffer((lanes,), "int32", scope="local", annotations=ON_STACK)
            total = T.alloc_buffer((1,), "int32", scope="local", annotations=ON_STACK)
            # Keep the keys above the k-th largest, and as many equal to it as fit, in column order.
            kth_key(X, t, c, k, threshold, ties)
            kept[0] = 0
            for col in range(c):
                key[0] = order_key(X[t, col])
                if key[0] > threshold[0] or (key[0] == threshold[0] and ties[0] > 0):
                    if key[0] == threshold[0]:
                        ties[0] = ties[0] - 1
                    kept_key[kept[0]] = key[0]
                    kept_col[kept[0]] = col
                    kept[0] = kept[0] + 1
            # A kept column's place: the kept columns with a larger key, or an equal one to its left.
            for i in range(kept[0]):
                for l in T.vectorized(lanes):
                    lane_count[l] = 0
                for jo in range((kept[0] + lanes - 1) // lanes):
                    for l in T.vectorized(lanes):
                        lane_count[l] = lane_count[l] + T.Select(T.And(jo * lanes + l < kept[0], T.Or(
                            kept_key[jo * lanes + l] > kept_key[i],
                            T.And(kept_key[jo * lanes + l] == kept_key[i], jo * lanes + l < i))), 1, 0)
                lane_sum(lane_count, total)
                IDS[t, total[0]] = kept_col[i]
            for j in range(k - kept[0]):
                IDS[t, kept[0] + j] = -1
    return topk_rows_function(k, select)


def topk_rows_function(k: int, select):
    """The ``topk_rows`` kernel (x [N, C] -> ids [N, k]) whose work is the macro
    ``select(X, IDS, n, c)``: the CPU's, or the GPU targets' (``kernels.gpu_topk``)."""
    @T.prim_func
    def f(x: T.handle, ids: T.handle):
        n = T.int32()
        c = T.int32()
        X = T.match_buffer(x, (n, c), F32)
        IDS = T.match_buffer(ids, (n, k), "int32")
        select(X, IDS, n, c)
    return f
