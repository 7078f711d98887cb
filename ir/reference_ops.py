"""Reference ops: numpy fp32 implementations of every IR op, what each op means.

These are the oracle for every backend. Stateless ops are plain functions of arrays; the
stateful ones (``kv_write``, ``compress``, ``index_score``, ``sparse_attn``) read and write a
KV store through the small interface documented on :class:`KVStore`, implemented by the dense
per-request cache (``dsv4c.runtime.dense_cache``) and by the paged pool.

Compressed entries are computed by one pooling routine whatever the chunking: tokens enter
the compressor ring, and every window that closes is pooled from exactly the same rows with
the same sequential reductions, so prefill, chunked prefill and decode emit bit-identical
entries.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from dsv4c.artifact import lowbit
from dsv4c.artifact.step_requests import request_groups
from dsv4c.errors import UsageError
from dsv4c.ir.ops import COLLECTIVE_OPS

F32 = np.float32


class KVStore(Protocol):
    """What the stateful kernels need from a KV cache (per request ``seq``, per ``layer``)."""

    def window_rows(self, layer: int, seq: int, start: int, stop: int) -> np.ndarray:
        """Window KV rows of positions ``[start, stop)`` written by earlier steps, ``[stop-start, Dh]``."""

    def write_window(self, layer: int, seq: int, positions: np.ndarray, rows: np.ndarray) -> None: ...

    def ring(self, layer: int, stream: str, seq: int) -> tuple[np.ndarray, np.ndarray]:
        """The compressor ring ``(kv, score)`` of fp32 rows, updated in place."""

    def write_entries(self, layer: int, stream: str, seq: int, first: int, entries: np.ndarray) -> None: ...

    def entries(self, layer: int, stream: str, seq: int, count: int) -> np.ndarray:
        """Compressed entries ``0 .. count-1`` of a request, ``[count, d]``."""


# ----------------------------------------------------------------------------- basics


def rmsnorm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    x = x.astype(F32, copy=False)
    y = x * (F32(1.0) / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + F32(eps)))
    return (y * w if w is not None else y).astype(F32, copy=False)


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w.T``, one row at a time: a matrix product of several rows sums in another order
    than one of a single row (BLAS picks its kernel by shape), and a token's row must not depend
    on what else its step feeds (a verify step's tokens against plain decode's, one at a time)."""
    wt = w.T
    return np.stack([np.matmul(row, wt) for row in x]).astype(F32, copy=False) if len(x) else \
        np.matmul(x, wt).astype(F32, copy=False)


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, rope_dim: int, inverse: bool) -> np.ndarray:
    """GPT-J (interleaved pairs) rotation of the trailing ``rope_dim`` channels."""
    angles = positions.astype(F32)[:, None] * inv_freq[None, :]  # [T, rope_dim/2]
    cos, sin = np.cos(angles).astype(F32), np.sin(angles).astype(F32)
    if inverse:
        sin = -sin
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (rope_dim // 2,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    out = x.astype(F32, copy=True)
    even, odd = x[..., -rope_dim::2], x[..., -rope_dim + 1::2]
    out[..., -rope_dim::2] = even * cos - odd * sin
    out[..., -rope_dim + 1::2] = odd * cos + even * sin
    return out


def sigmoid(x: np.ndarray) -> np.ndarray:
    return (F32(1.0) / (F32(1.0) + np.exp(-x))).astype(F32)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return (e / np.sum(e, axis=axis, keepdims=True)).astype(F32)


# ----------------------------------------------------------------------------- mHC


def mhc_pre(h, fn, base, scale, hc_mult, sinkhorn_iters, hc_eps, norm_eps):
    """Collapse N streams into the block input; return (y, post, comb). All fp32."""
    pre, post, comb = mhc_mixes(h, fn, base, scale, hc_mult, sinkhorn_iters, hc_eps, norm_eps)
    return np.einsum("tn,tnd->td", pre, h).astype(F32), post, comb


def mhc_mixes(h, fn, base, scale, hc_mult, sinkhorn_iters, hc_eps, norm_eps):
    """A site's (pre, post, comb) from its input streams."""
    t, n, d = h.shape
    mix = linear(rmsnorm(h.reshape(t, n * d), None, norm_eps), fn)
    eps = F32(hc_eps)
    pre = sigmoid(mix[:, :n] * scale[0] + base[:n]) + eps
    post = F32(2.0) * sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
    comb = softmax(mix[:, 2 * n:].reshape(t, n, n) * scale[2] + base[2 * n:].reshape(n, n), axis=-1) + eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    return pre.astype(F32), post.astype(F32), comb.astype(F32)


def hc_mean(h):
    """Mean over the streams: summed in stream order 0 .. N-1, then times 1/N."""
    acc = h[:, 0].astype(F32, copy=True)
    for k in range(1, h.shape[1]):
        acc += h[:, k]
    return (acc * F32(1.0 / h.shape[1])).astype(F32)


def mhc_post(out, h, post, comb):
    """h'[k] = post[k] * out + sum_j comb[j, k] * h[j]."""
    return (post[:, :, None] * out[:, None, :] + np.einsum("tjk,tjd->tkd", comb, h)).astype(F32)


def hc_head(h, fn, base, scale, hc_mult, hc_eps, norm_eps):
    t, n, d = h.shape
    mix = linear(rmsnorm(h.reshape(t, n * d), None, norm_eps), fn)
    pre = sigmoid(mix * scale[0] + base) + F32(hc_eps)
    return np.einsum("tn,tnd->td", pre, h).astype(F32)


# ----------------------------------------------------------------------------- MoE


def moe_route(y, gate, table, tokens, *images, mode: str, k: int, scale: float, temp: float = 1.0):
    """``images``: ``(bias_vl, image_index)``, the bias the tokens of image spans select with."""
    logits = linear(y, gate)
    if temp != 1.0:
        logits = (logits / F32(temp)).astype(F32)
    scores = np.sqrt(np.logaddexp(F32(0.0), logits)).astype(F32)  # sqrt(softplus)
    if mode == "hash":
        ids = table[tokens].astype(np.int32)
    else:
        # The bias only selects; a stable sort makes ties pick the lower expert id.
        bias = table if not images else np.where(images[1][:, None] >= 0, images[0], table)
        ids = np.argsort(-(scores + bias), axis=-1, kind="stable")[:, :k].astype(np.int32)
    w = np.take_along_axis(scores, ids, axis=-1)
    w = w / (w.sum(axis=-1, keepdims=True) + F32(1e-20)) * F32(scale)
    return w.astype(F32), ids


def swiglu(x, w1, w2, w3, limit: float):
    gate = np.minimum(linear(x, w1), F32(limit))
    up = np.clip(linear(x, w3), -F32(limit), F32(limit))
    act = gate / (F32(1.0) + np.exp(-gate))  # silu
    return linear((act * up).astype(F32), w2)


def experts(y, weights, ids, w1, w2, w3, limit: float):
    out = np.zeros_like(y, dtype=F32)
    for e in np.unique(ids[ids >= 0]):  # -1: an expert another rank holds (shard_ids)
        tok, slot = np.nonzero(ids == e)
        out_e = swiglu(y[tok], w1[e], w2[e], w3[e], limit) * weights[tok, slot][:, None]
        np.add.at(out, tok, out_e)
    return out


def grouped_linear(x, w, groups: int):
    wg = w.reshape(groups, -1, x.shape[2])  # [G, R, in_g]
    return np.einsum("tgi,gri->tgr", x, wg).astype(F32)


# ----------------------------------------------------------------------------- QAT round trips


def fp8_roundtrip(x, block: int, channels: int):
    """The official KV row format: FP8 e4m3 round trip of the leading ``channels`` (NoPE) in
    power-of-two-scaled blocks, BF16 for the rope channels (never quantized further)."""
    out = np.empty_like(x, dtype=F32)
    out[..., :channels] = lowbit.fp8_roundtrip(x[..., :channels], block)
    out[..., channels:] = lowbit.bf16_roundtrip(x[..., channels:])
    return out


# ----------------------------------------------------------------------------- KV state


def kv_write(store: KVStore, kv, positions, seq_ids, layer: int, window: int) -> None:
    for seq, idx, _ in request_groups(positions, seq_ids):
        keep = idx[-window:]  # older rows of this step fall out of the window anyway
        store.write_window(layer, seq, positions[keep], kv[keep])


def pool_windows(kv: np.ndarray, score: np.ndarray) -> np.ndarray:
    """Gated pooling of closed windows: ``[n, S, d] -> [n, d]``, softmax over S per channel.

    The sums run sequentially over S so that a window's result never depends on how many
    windows are pooled together (chunking invariance)."""
    m = score.max(axis=1)
    num = np.zeros(m.shape, F32)
    den = np.zeros(m.shape, F32)
    for s in range(kv.shape[1]):
        e = np.exp(score[:, s] - m)
        den += e
        num += e * kv[:, s]
    return (num / den).astype(F32)


def compress(store: KVStore, kv, gate, ape, norm, positions, seq_ids, *, layer, stream, ratio, overlap, head_dim,
             rope_dim, entry_quant, eps, inv_freq) -> None:
    r, d = ratio, head_dim
    # Position p owns ring row p mod ``slots`` (the previous window and the open one with
    # overlap), as in the compiled kernels: what a step writes depends only on the positions it
    # feeds, and taking a token back (speculative decoding) restores its rows alone.
    slots = 2 * r if overlap else r
    score_all = gate + ape[positions % r]
    for seq, idx, p0 in request_groups(positions, seq_ids):
        ring_kv, ring_score = store.ring(layer, stream, seq)
        if p0 == 0:  # no window before the first: zero kv, -inf scores (weight 0)
            ring_kv[:], ring_score[:] = F32(0), -np.inf
        end = p0 + len(idx)
        # Rows of positions start .. end-1: from the ring before p0, from the step after.
        start = (p0 // r - (1 if overlap else 0)) * r
        held = np.arange(start, p0) % slots
        seq_kv = np.concatenate([ring_kv[held], kv[idx]])
        seq_score = np.concatenate([ring_score[held], score_all[idx]])
        first, closed = p0 // r, end // r - p0 // r
        if closed:
            at = (np.arange(first, first + closed) * r - start)[:, None] + np.arange(r)  # [closed, r]
            win_kv, win_score = seq_kv[at], seq_score[at]
            if overlap:
                # Entry w pools the first half of window w-1's columns with the second half of
                # window w's (window -1: the emptied ring's rows).
                prev_kv, prev_score = seq_kv[at - r], seq_score[at - r]
                pool_kv = np.concatenate([prev_kv[..., :d], win_kv[..., d:]], axis=1)
                pool_score = np.concatenate([prev_score[..., :d], win_score[..., d:]], axis=1)
            else:
                pool_kv, pool_score = win_kv, win_score
            entries = rmsnorm(pool_windows(pool_kv, pool_score), norm, eps)
            entry_pos = (np.arange(first, first + closed) * r).astype(np.int32)
            entries = rope(entries, entry_pos, inv_freq, rope_dim, inverse=False)
            if entry_quant == "fp8":
                entries = fp8_roundtrip(entries, 64, d - rope_dim)
            elif entry_quant == "hadamard_fp4":
                entries = lowbit.fp4_roundtrip(lowbit.hadamard(entries), 32)
            store.write_entries(layer, stream, seq, first, entries)
        kept = np.arange(max(p0, end - slots), end)
        ring_kv[kept % slots] = seq_kv[kept - start]
        ring_score[kept % slots] = seq_score[kept - start]


def index_score(store: KVStore, q, w, positions, seq_ids, *, layer, ratio):
    """I[t, s] = sum_h w[t,h] * H^-0.5 * relu(<q[t,h], k[s]>) * d^-0.5; invisible entries -inf."""
    t, heads, dim = q.shape
    visible = (positions + 1) // ratio
    out = np.full((t, max(int(visible.max(initial=0)), 0)), -np.inf, F32)
    weights = w * F32(heads ** -0.5) * F32(dim ** -0.5)
    for seq, idx, _ in request_groups(positions, seq_ids):
        count = int(visible[idx].max())
        if count == 0:
            continue
        keys = store.entries(layer, "index", seq, count)  # [E, d]
        dots = np.maximum(np.einsum("thd,ed->the", q[idx], keys), F32(0.0))
        scores = np.einsum("the,th->te", dots, weights[idx]).astype(F32)
        scores[np.arange(count)[None, :] >= visible[idx][:, None]] = -np.inf
        out[idx, :count] = scores
    return out


def index_topk(scores: np.ndarray, k: int) -> np.ndarray:
    """Top-k entry numbers per query, ``-1`` where fewer are visible. Ties go to the lower
    entry number (stable sort), so every chunking and batch selects the same rows."""
    t, e = scores.shape
    out = np.full((t, k), -1, np.int32)
    if e == 0:
        return out
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    chosen = np.take_along_axis(scores, order, axis=1)
    order[~np.isfinite(chosen)] = -1
    out[:, :order.shape[1]] = order
    return out


def _attend(q, rows, sink, scale):
    """One query's heads ``[H, d]`` over ``rows``, the sink in the softmax denominator."""
    logits = (q @ rows.T) * F32(scale)  # [H, n]
    m = np.maximum(logits.max(axis=1), sink)
    e = np.exp(logits - m[:, None])
    den = e.sum(axis=1) + np.exp(sink - m)
    return (e @ rows) / den[:, None]


def sparse_attn(store: KVStore, q, kv, sink, positions, seq_ids, topk=None, *, layer, kind, ratio, window, scale):
    """Softmax attention with the sink in the denominator over window + compressed rows."""
    t, heads, dim = q.shape
    out = np.zeros_like(q, dtype=F32)
    if kind == "block":  # a draft block: the ring before the block, then the whole block, for every row
        for seq, idx, p0 in request_groups(positions, seq_ids):
            rows = np.concatenate([store.window_rows(layer, seq, max(0, p0 - window), p0), kv[idx]])
            for ti in idx:
                out[ti] = _attend(q[ti], rows, sink, scale)
        return out
    for seq, idx, p0 in request_groups(positions, seq_ids):
        old_start = max(0, p0 - window + 1)
        keys = np.concatenate([store.window_rows(layer, seq, old_start, p0), kv[idx]])  # positions old_start..
        n_comp = 0
        if kind != "sliding":
            n_comp = int((positions[idx[-1]] + 1) // ratio)
            comp = store.entries(layer, "main", seq, n_comp)
        for i, ti in enumerate(idx):
            p = p0 + i
            lo = max(0, p - window + 1) - old_start
            rows = keys[lo:p - old_start + 1]
            if kind == "hca":
                rows = np.concatenate([rows, comp[:(p + 1) // ratio]])
            elif kind == "csa":
                sel = topk[ti][topk[ti] >= 0]
                rows = np.concatenate([rows, comp[sel]])
            out[ti] = _attend(q[ti], rows, sink, scale)
    return out.astype(F32)


def run_node(op: str, args: list[Any], attrs: dict[str, Any], ctx) -> Any:
    """Execute one op. ``ctx`` provides ``store`` (KVStore) and ``inv_freq(table)``."""
    a = attrs
    if op == "embed":  # an id of -1 (another rank's vocab row, shard_ids) embeds as zeros
        return np.where(args[0][:, None] >= 0, args[1][np.maximum(args[0], 0)], F32(0)).astype(F32)
    if op == "shard_ids":
        local = args[0] - args[1][0]
        return np.where((local >= 0) & (local < a["size"]), local, -1).astype(np.int32)
    if op in COLLECTIVE_OPS:
        raise UsageError(f"{op} joins the ranks of a tensor-parallel program, which runs compiled, one process "
                         "per rank; the reference interpreter runs single-device programs")
    if op == "hc_expand":
        return np.repeat(args[0][:, None, :], a["hc_mult"], axis=1)
    if op == "hc_mean":
        return hc_mean(args[0])
    if op == "concat":
        return np.concatenate(args, axis=-1).astype(F32, copy=False)
    if op == "mhc_pre":
        return mhc_pre(*args, a["hc_mult"], a["sinkhorn_iters"], a["hc_eps"], a["norm_eps"])
    if op == "mhc_post":
        return mhc_post(*args)
    if op == "mhc_seam":
        h = mhc_post(*args[:4])
        return (h,) + mhc_pre(h, *args[4:], a["hc_mult"], a["sinkhorn_iters"], a["hc_eps"], a["norm_eps"])
    if op == "hc_head":
        return hc_head(*args, a["hc_mult"], a["hc_eps"], a["norm_eps"])
    if op == "mhc_post_head":
        h = mhc_post(*args[:4])
        return h, hc_head(h, *args[4:], a["hc_mult"], a["hc_eps"], a["norm_eps"])
    if op == "rmsnorm":
        return rmsnorm(args[0], args[1] if len(args) > 1 else None, a["eps"])
    if op in ("linear", "lm_head"):
        return linear(*args)
    if op == "linear_split":
        y = linear(*args)
        return tuple(np.split(y, np.cumsum(a["sizes"])[:-1], axis=-1))
    if op == "reshape":
        return args[0].reshape((args[0].shape[0],) + tuple(a["shape"][1:]))
    if op == "add":
        return (args[0] + args[1]).astype(F32)
    if op == "rope":
        return rope(args[0], args[1], ctx.inv_freq(a["rope"]), a["rope_dim"], a["inverse"])
    if op == "rmsnorm_rope":
        x = rmsnorm(args[0], args[1] if len(args) == 3 else None, a["eps"])
        return rope(x, args[-1], ctx.inv_freq(a["rope"]), a["rope_dim"], False)
    if op == "fp8_roundtrip":
        return fp8_roundtrip(args[0], a["block"], a["channels"])
    if op == "fp4_roundtrip":
        return lowbit.fp4_roundtrip(args[0], a["block"])
    if op == "hadamard":
        return lowbit.hadamard(args[0])
    if op == "kv_write":
        kv_write(ctx.store, *args, layer=a["layer"], window=a["window"])
        return None
    if op == "compress":
        compress(ctx.store, *args, layer=a["layer"], stream=a["stream"], ratio=a["ratio"], overlap=a["overlap"],
                 head_dim=a["head_dim"], rope_dim=a["rope_dim"], entry_quant=a["entry_quant"], eps=a["eps"],
                 inv_freq=ctx.inv_freq("compress"))
        return None
    if op == "index_score":
        return index_score(ctx.store, *args[:4], layer=a["layer"], ratio=a["ratio"])
    if op == "index_topk":
        return index_topk(args[0], a["k"])
    if op == "sparse_attn":
        topk = args[6] if len(args) > 6 else None
        return sparse_attn(ctx.store, *args[:5], topk, layer=a["layer"], kind=a["kind"], ratio=a["ratio"],
                           window=a["window"], scale=a["scale"])
    if op == "grouped_linear":
        return grouped_linear(*args, a["groups"])
    if op == "moe_route":
        return moe_route(*args, mode=a["mode"], k=a["k"], scale=a["scale"], temp=a.get("temp", 1.0))
    if op == "experts":
        return experts(*args, a["limit"])
    if op == "shared_expert":
        return swiglu(args[0], *args[1:], a["limit"])
    raise NotImplementedError(f"the reference ops do not implement op {op!r}")
