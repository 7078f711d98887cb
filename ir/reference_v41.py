"""Reference ops of DeepSeek-V4.1 (docs/v41.md): numpy fp32, what each of its ops means.

They run on the same :class:`~dsv4c.ir.reference_ops.KVStore` as V4's: a group's compressed rows
and index keys are the KV source's entries (the pool maps every layer of the group onto them), its
compressor ring is the source's ``main`` ring. Reductions that feed a fake-quant round trip keep
the order of transformers' reference where that is cheap (the gated pool's softmax, then the
weighted sum), since a one-ulp difference there can cross a rounding midpoint.
"""

from __future__ import annotations

import numpy as np

from dsv4c.artifact import lowbit
from dsv4c.artifact.step_requests import request_groups
from dsv4c.ir.reference_ops import F32, KVStore, linear, mhc_mixes, rmsnorm, rope, sigmoid

V41_OPS = ("mhc_mix", "hc_collapse", "v41_roundtrip", "shared_compress", "candidate_mask", "engram", "image_splice")


def hc_collapse(h, pre=None):
    """``sum_j pre[j] * h[j]`` (streams summed in order); without ``pre``, stream 0."""
    if pre is None:
        return h[:, 0].astype(F32, copy=True)
    return (pre[:, :, None] * h).sum(axis=1, dtype=F32)


def _gated_pool(kv: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """``[n, r, d] -> [n, d]``: per channel, the softmax of the r gates weighs the r rows."""
    e = np.exp(gate - gate.max(axis=1, keepdims=True))
    return (kv * (e / e.sum(axis=1, keepdims=True))).sum(axis=1, dtype=F32)


def shared_compress(store: KVStore, kv, norm, positions, seq_ids, *rest, layer, ratio, head_dim, index_dim, rope_dim,
                    eps, index_keys, fake_quant, inv_freq) -> None:
    r = ratio
    gate = rest[0] if r > 1 else None
    wk, k_norm = rest[-2:] if index_keys else (None, None)

    def quant(x, fmt):
        return lowbit.v41_roundtrip(x, fmt) if fake_quant else x

    for seq, idx, p0 in request_groups(positions, seq_ids):
        ring_kv, ring_gate = store.ring(layer, "main", seq)
        pending = p0 % r
        seq_kv = np.concatenate([ring_kv[:pending], kv[idx]])
        seq_gate = np.concatenate([ring_gate[:pending], gate[idx]]) if gate is not None else None
        closed = len(seq_kv) // r
        if closed:
            if gate is None:  # ratio 1: each token's row is its latent
                latent = seq_kv[:closed]
            else:
                latent = _gated_pool(seq_kv[:closed * r].reshape(closed, r, -1),
                                     seq_gate[:closed * r].reshape(closed, r, -1))
            latent = rmsnorm(latent, norm, eps)
            first = p0 // r
            row_pos = (np.arange(first, first + closed) * r).astype(np.int32)
            rows = rope(latent, row_pos, inv_freq, rope_dim, inverse=False)
            store.write_entries(layer, "main", seq, first, quant(rows, "fp4_e4m3_b16"))
            if index_keys:
                keys = rope(rmsnorm(linear(latent, wk), k_norm, eps), row_pos, inv_freq, rope_dim, inverse=False)
                store.write_entries(layer, "index", seq, first, quant(keys, "fp4_b32"))
        # Position p owns ring row p mod r, whether or not its window closed in this step: a
        # speculative rollback puts back the rows of rejected positions only, so the accepted
        # ones of a window the rejected ones closed must already be in the ring.
        last = idx[-r:]
        ring_kv[positions[last] % r] = kv[last]
        if gate is not None:
            ring_gate[positions[last] % r] = gate[last]


def candidate_mask(scores, positions, seq_ids, *, ratio, block, blocks):
    t, e = scores.shape
    out = np.full((t, e), -np.inf, F32)
    n_blocks = -(-e // block)
    if e == 0:
        return out
    padded = np.full((t, n_blocks * block), -np.inf, F32)
    padded[:, :e] = scores
    block_score = padded.reshape(t, n_blocks, block).max(axis=2)
    visible = (positions.astype(np.int64) + 1) // ratio
    newest = np.nonzero(visible > 0)[0]
    block_score[newest, (visible[newest] - 1) // block] = np.inf
    keep = min(blocks, n_blocks)
    # Ties go to the lower block (stable sort), as the index top-k's do.
    order = np.argsort(-block_score, axis=1, kind="stable")[:, :keep]
    kept = np.zeros((t, n_blocks), bool)
    rows = np.repeat(np.arange(t), keep)
    picked = order.reshape(-1)
    reachable = block_score[rows, picked] > -np.inf  # fewer reachable blocks than kept: all of them
    kept[rows[reachable], picked[reachable]] = True
    out[np.repeat(kept, block, axis=1)[:, :e]] = 0
    return out


def engram(h, ids, table, wkv, q_weight, k_weight, *, slot, eps):
    t, n, d = h.shape
    rows = table[ids[:, slot]].reshape(t, -1)  # [T, C * de], columns in hash-column order
    kv = linear(rows, wkv)
    key, value = kv[:, :n * d].reshape(t, n, d), kv[:, n * d:]
    weight = q_weight * k_weight
    rstd = (F32(1) / np.sqrt(np.mean(h * h, axis=-1) + F32(eps))) * \
        (F32(1) / np.sqrt(np.mean(key * key, axis=-1) + F32(eps)))
    dot = (h * weight * key).sum(axis=-1, dtype=F32) * rstd * F32(d ** -0.5)
    gate = sigmoid(np.copysign(np.sqrt(np.maximum(np.abs(dot), F32(1e-6))), dot).astype(F32))
    return (h + gate[:, :, None] * value[:, None, :]).astype(F32)


def image_splice(x, image_index, image_rows):
    """``x`` with the rows of image-span tokens (``image_index >= 0``) taken from ``image_rows``."""
    return np.where(image_index[:, None] >= 0, image_rows[np.maximum(image_index, 0)] if len(image_rows) else x,
                    x).astype(F32)


def run_v41(op: str, args: list, a: dict, ctx):
    if op == "image_splice":
        return image_splice(*args)
    if op == "mhc_mix":
        return mhc_mixes(*args, a["hc_mult"], a["sinkhorn_iters"], a["hc_eps"], a["norm_eps"])
    if op == "hc_collapse":
        return hc_collapse(*args)
    if op == "v41_roundtrip":
        return lowbit.v41_roundtrip(args[0], a["format"])
    if op == "shared_compress":
        shared_compress(ctx.store, *args, layer=a["layer"], ratio=a["ratio"], head_dim=a["head_dim"],
                        index_dim=a["index_dim"], rope_dim=a["rope_dim"], eps=a["eps"], index_keys=a["index_keys"],
                        fake_quant=a["fake_quant"], inv_freq=ctx.inv_freq("compress"))
        return None
    if op == "candidate_mask":
        return candidate_mask(*args, ratio=a["ratio"], block=a["block"], blocks=a["blocks"])
    if op == "engram":
        return engram(*args, slot=a["slot"], eps=a["eps"])
    raise NotImplementedError(f"the V4.1 reference ops do not implement op {op!r}")
