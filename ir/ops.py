"""Op definitions: the attributes each op needs and how its output types follow from its inputs.

One entry per op. The verifier and the builder both call :func:`infer_types`, so a node's
recorded output types are always what its inputs imply. Semantics live with the reference
ops (``dsv4c.ir.reference_ops``), the numpy implementation every backend is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from dsv4c.errors import IRError
from dsv4c.ir.types import STATE, Dim, StateType, TensorType, Type


@dataclass(frozen=True)
class OpDef:
    name: str
    attrs: tuple[str, ...]  # required attributes
    infer: Callable[[list[Type], dict[str, Any]], list[Type]]
    effect: bool = False  # writes KV / compressor state: never dead code
    arity: tuple[int, ...] = ()  # accepted input counts (empty: any)


OPS: dict[str, OpDef] = {}


def _op(name: str, attrs: tuple[str, ...] = (), effect: bool = False, arity: tuple[int, ...] = ()):
    def register(fn):
        OPS[name] = OpDef(name, attrs, fn, effect, arity)
        return fn

    return register


def _t(ty: Type, what: str) -> TensorType:
    if not isinstance(ty, TensorType):
        raise IRError(f"{what} must be a tensor, got {ty}")
    return ty


def _same(a: Dim, b: Dim, what: str) -> None:
    if a != b:
        raise IRError(f"{what}: {a} != {b}")


def _float(ty: Type, what: str, rank: int | None = None) -> TensorType:
    t = _t(ty, what)
    if t.dtype != "f32":
        raise IRError(f"{what} must be f32, got {t}")
    if rank is not None and len(t.shape) != rank:
        raise IRError(f"{what} must have rank {rank}, got {t}")
    return t


def _ints(ty: Type, what: str, rank: int) -> TensorType:
    t = _t(ty, what)
    if t.dtype not in ("i32", "i64") or len(t.shape) != rank:
        raise IRError(f"{what} must be an integer tensor of rank {rank}, got {t}")
    return t


def _state(ty: Type, what: str) -> None:
    if not isinstance(ty, StateType):
        raise IRError(f"{what} must be a state token, got {ty}")


def f32(*shape: Dim) -> TensorType:
    return TensorType("f32", tuple(shape))


def i32(*shape: Dim) -> TensorType:
    return TensorType("i32", tuple(shape))


# ----------------------------------------------------------------------------- ops


@_op("embed", arity=(2,))
def _embed(ins, attrs):
    tok = _ints(ins[0], "embed tokens", 1)
    w = _float(ins[1], "embed table", 2)
    return [f32(tok.shape[0], w.shape[1])]


@_op("hc_expand", attrs=("hc_mult",), arity=(1,))
def _hc_expand(ins, attrs):
    x = _float(ins[0], "hc_expand input", 2)
    return [f32(x.shape[0], attrs["hc_mult"], x.shape[1])]


def _check_hc(h: TensorType, fn: TensorType, base: TensorType, scale: TensorType, mix: int, n_scale: int, what: str):
    t, n, d = h.shape
    _same(fn.shape, (mix, n * d) if isinstance(n, int) and isinstance(d, int) else fn.shape, f"{what} fn shape")
    _same(base.shape, (mix,), f"{what} base shape")
    _same(scale.shape, (n_scale,), f"{what} scale shape")


@_op("mhc_pre", attrs=("hc_mult", "sinkhorn_iters", "hc_eps", "norm_eps"), arity=(4,))
def _mhc_pre(ins, attrs):
    h = _float(ins[0], "mhc_pre streams", 3)
    n = attrs["hc_mult"]
    _same(h.shape[1], n, "mhc_pre stream count")
    _check_hc(h, _float(ins[1], "fn", 2), _float(ins[2], "base", 1), _float(ins[3], "scale", 1), (2 + n) * n, 3,
              "mhc_pre")
    t, _, d = h.shape
    return [f32(t, d), f32(t, n), f32(t, n, n)]


@_op("mhc_post", arity=(4,))
def _mhc_post(ins, attrs):
    out = _float(ins[0], "mhc_post block output", 2)
    h = _float(ins[1], "mhc_post streams", 3)
    post = _float(ins[2], "mhc_post post", 2)
    comb = _float(ins[3], "mhc_post comb", 3)
    t, n, d = h.shape
    _same(out.shape, (t, d), "mhc_post output shape")
    _same(post.shape, (t, n), "mhc_post post shape")
    _same(comb.shape, (t, n, n), "mhc_post comb shape")
    return [h]


@_op("mhc_seam", attrs=("hc_mult", "sinkhorn_iters", "hc_eps", "norm_eps"), arity=(7,))
def _mhc_seam(ins, attrs):
    """mhc_post of one sub-layer fused with mhc_pre of the next: (h', y, post', comb')."""
    h_new = _mhc_post(ins[:4], attrs)[0]
    return [h_new] + _mhc_pre([h_new] + ins[4:], attrs)


@_op("mhc_post_head", attrs=("hc_mult", "hc_eps", "norm_eps"), arity=(7,))
def _mhc_post_head(ins, attrs):
    """The last mhc_post folded into hc_head: (h', y)."""
    h_new = _mhc_post(ins[:4], attrs)[0]
    return [h_new] + _hc_head([h_new] + ins[4:], attrs)


@_op("hc_head", attrs=("hc_mult", "hc_eps", "norm_eps"), arity=(4,))
def _hc_head(ins, attrs):
    h = _float(ins[0], "hc_head streams", 3)
    n = attrs["hc_mult"]
    _check_hc(h, _float(ins[1], "fn", 2), _float(ins[2], "base", 1), _float(ins[3], "scale", 1), n, 1, "hc_head")
    return [f32(h.shape[0], h.shape[2])]


@_op("hc_mean", arity=(1,))
def _hc_mean(ins, attrs):
    """The plain mean of the N hyper-connection streams (DSpark's tap of a target layer's input):
    summed in stream order 0 .. N-1, then times 1/N."""
    h = _float(ins[0], "hc_mean streams", 3)
    return [f32(h.shape[0], h.shape[2])]


@_op("concat")
def _concat(ins, attrs):
    """Rank-2 tensors of the same rows side by side along the last axis, in input order."""
    if len(ins) < 2:
        raise IRError(f"concat takes at least 2 inputs, got {len(ins)}")
    parts = [_float(v, f"concat input {i}", 2) for i, v in enumerate(ins)]
    width = 0
    for i, p in enumerate(parts):
        _same(p.shape[0], parts[0].shape[0], f"concat input {i} rows")
        if not isinstance(p.shape[1], int):
            raise IRError(f"concat input {i} has a symbolic width {p.shape[1]}")
        width += p.shape[1]
    return [f32(parts[0].shape[0], width)]


@_op("rmsnorm", attrs=("eps",), arity=(1, 2))
def _rmsnorm(ins, attrs):
    x = _float(ins[0], "rmsnorm input")
    if len(ins) == 2:
        w = _float(ins[1], "rmsnorm weight", 1)
        _same(w.shape[0], x.shape[-1], "rmsnorm weight size")
    return [x]


@_op("linear", attrs=("quant",), arity=(2,))
def _linear(ins, attrs):
    x = _float(ins[0], "linear input")
    w = _float(ins[1], "linear weight", 2)
    _same(x.shape[-1], w.shape[1], "linear reduction dim")
    return [f32(*x.shape[:-1], w.shape[0])]


@_op("linear_split", attrs=("quant", "sizes"), arity=(2,))
def _linear_split(ins, attrs):
    """One GEMM over concatenated weights, outputs split along the last axis."""
    (y,) = _linear(ins, attrs)
    if sum(attrs["sizes"]) != y.shape[-1]:
        raise IRError(f"linear_split sizes {attrs['sizes']} do not add up to {y.shape[-1]}")
    return [f32(*y.shape[:-1], s) for s in attrs["sizes"]]


@_op("lm_head", attrs=("quant",), arity=(2,))
def _lm_head(ins, attrs):
    return _linear(ins, attrs)


@_op("reshape", attrs=("shape",), arity=(1,))
def _reshape(ins, attrs):
    x = _float(ins[0], "reshape input")
    shape = tuple(attrs["shape"])
    if x.shape[0] != shape[0]:
        raise IRError(f"reshape must keep the token dim: {x.shape} -> {shape}")
    _same(_numel(x.shape[1:]), _numel(shape[1:]), "reshape element count")
    return [f32(*shape)]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        if not isinstance(d, int):
            raise IRError(f"reshape over symbolic dim {d}")
        n *= d
    return n


@_op("add", arity=(2,))
def _add(ins, attrs):
    a, b = _float(ins[0], "add lhs"), _float(ins[1], "add rhs")
    _same(a.shape, b.shape, "add shapes")
    return [a]


@_op("rope", attrs=("rope", "rope_dim", "inverse"), arity=(2,))
def _rope(ins, attrs):
    x = _float(ins[0], "rope input")
    pos = _ints(ins[1], "rope positions", 1)
    _same(x.shape[0], pos.shape[0], "rope token dim")
    if attrs["rope"] not in ("main", "compress"):
        raise IRError(f"rope table {attrs['rope']!r} is not main/compress")
    return [x]


@_op("rmsnorm_rope", attrs=("eps", "rope", "rope_dim"), arity=(2, 3))
def _rmsnorm_rope(ins, attrs):
    """rmsnorm (weighted when given a weight) then rope at the token positions, one pass over x."""
    (x,) = _rmsnorm(ins[:-1], attrs)
    return _rope([x, ins[-1]], {**attrs, "inverse": False})


# Quantization round trips of the official QAT reference (numerics="qat").
@_op("fp8_roundtrip", attrs=("block", "channels"), arity=(1,))
def _fp8_rt(ins, attrs):
    return [_float(ins[0], "fp8_roundtrip input")]


@_op("fp4_roundtrip", attrs=("block",), arity=(1,))
def _fp4_rt(ins, attrs):
    return [_float(ins[0], "fp4_roundtrip input")]


@_op("hadamard", arity=(1,))
def _hadamard(ins, attrs):
    x = _float(ins[0], "hadamard input")
    d = x.shape[-1]
    if not isinstance(d, int) or d & (d - 1):
        raise IRError(f"hadamard needs a power-of-two last dim, got {d}")
    return [x]


def _token_meta(ins, first: int, what: str) -> Dim:
    pos = _ints(ins[first], f"{what} positions", 1)
    seq = _ints(ins[first + 1], f"{what} sequence ids", 1)
    _same(pos.shape, seq.shape, f"{what} positions vs sequence ids")
    return pos.shape[0]


@_op("kv_write", attrs=("layer", "window"), effect=True, arity=(3,))
def _kv_write(ins, attrs):
    kv = _float(ins[0], "kv_write rows", 2)
    _same(kv.shape[0], _token_meta(ins, 1, "kv_write"), "kv_write token dim")
    return [STATE]


@_op("compress", attrs=("layer", "stream", "ratio", "overlap", "head_dim", "rope_dim", "entry_quant", "eps"),
     effect=True, arity=(6,))
def _compress(ins, attrs):
    """Feed T tokens' (kv, gate) into the compressor ring; emit every window they close."""
    kv = _float(ins[0], "compress kv", 2)
    gate = _float(ins[1], "compress gate", 2)
    ape = _float(ins[2], "compress ape", 2)
    norm = _float(ins[3], "compress norm", 1)
    width = (2 if attrs["overlap"] else 1) * attrs["head_dim"]
    _same(kv.shape[1], width, "compress kv width")
    _same(gate.shape, kv.shape, "compress gate shape")
    _same(ape.shape, (attrs["ratio"], width), "compress ape shape")
    _same(norm.shape, (attrs["head_dim"],), "compress norm shape")
    _same(kv.shape[0], _token_meta(ins, 4, "compress"), "compress token dim")
    if attrs["stream"] not in ("main", "index") or attrs["entry_quant"] not in ("none", "fp8", "hadamard_fp4"):
        raise IRError(f"compress stream/entry_quant invalid: {attrs['stream']}/{attrs['entry_quant']}")
    return [STATE]


@_op("index_score", attrs=("layer", "ratio"), arity=(5,))
def _index_score(ins, attrs):
    q = _float(ins[0], "index_score queries", 3)
    w = _float(ins[1], "index_score head weights", 2)
    _same(w.shape, q.shape[:2], "index_score weights shape")
    _same(q.shape[0], _token_meta(ins, 2, "index_score"), "index_score token dim")
    _state(ins[4], "index_score index state")
    return [f32(q.shape[0], "E")]


@_op("index_topk", attrs=("k",), arity=(1,))
def _index_topk(ins, attrs):
    s = _float(ins[0], "index_topk scores", 2)
    return [i32(s.shape[0], attrs["k"])]


@_op("sparse_attn", attrs=("layer", "kind", "ratio", "window", "scale"), arity=(5, 6, 7))
def _sparse_attn(ins, attrs):
    """Attention of each query over its window rows (this step's kv for positions in the step,
    the cache for older ones) and its compressed rows: every visible one (HCA) or the index
    top-k (CSA). Compressed layers take the state token of their compressor, CSA the top-k.
    Kind ``block`` (a DSpark draft block): every query of a request attends the same keys, the
    ring rows of the ``window`` positions before the request's first position in the call and
    then all of its rows of the call (no causal mask)."""
    q = _float(ins[0], "sparse_attn queries", 3)
    kv = _float(ins[1], "sparse_attn step kv", 2)
    sink = _float(ins[2], "sparse_attn sink", 1)
    _same(kv.shape, (q.shape[0], q.shape[2]), "sparse_attn kv shape")
    _same(sink.shape, (q.shape[1],), "sparse_attn sink shape")
    _same(q.shape[0], _token_meta(ins, 3, "sparse_attn"), "sparse_attn token dim")
    expected = {"sliding": 5, "block": 5, "hca": 6, "csa": 7}.get(attrs["kind"])
    if expected != len(ins):
        raise IRError(f"sparse_attn of kind {attrs['kind']!r} takes {expected} inputs, got {len(ins)}")
    if attrs["kind"] == "block" and attrs["ratio"] != 0:
        raise IRError(f"sparse_attn of kind 'block' reads the window only (ratio 0), got ratio {attrs['ratio']}")
    if len(ins) > 5:
        _state(ins[5], "sparse_attn compressed state")
    if len(ins) > 6:
        _ints(ins[6], "sparse_attn top-k", 2)
    return [q]


@_op("grouped_linear", attrs=("groups", "quant"), arity=(2,))
def _grouped_linear(ins, attrs):
    x = _float(ins[0], "grouped_linear input", 3)
    w = _float(ins[1], "grouped_linear weight", 2)
    g = attrs["groups"]
    _same(x.shape[1], g, "grouped_linear group count")
    _same(w.shape[1], x.shape[2], "grouped_linear reduction dim")
    if w.shape[0] % g:
        raise IRError(f"grouped_linear weight rows {w.shape[0]} not divisible by {g} groups")
    return [f32(x.shape[0], g, w.shape[0] // g)]


@_op("moe_route", attrs=("mode", "k", "scale"), arity=(4, 6))  # optional "temp": logits divided by it (V4.1)
def _moe_route(ins, attrs):
    """``[y, gate, bias or tid2eid, tokens]``; a V4.1 model that sees images adds ``[bias_vl,
    image_index]``: the tokens whose ``image_index`` is >= 0 select with ``bias_vl``."""
    y = _float(ins[0], "moe_route input", 2)
    gate = _float(ins[1], "moe_route gate", 2)
    _same(gate.shape[1], y.shape[1], "moe_route gate width")
    if attrs["mode"] == "hash":
        tid2eid = _ints(ins[2], "moe_route tid2eid", 2)
        _same(tid2eid.shape[1], attrs["k"], "moe_route tid2eid width")
    elif attrs["mode"] == "topk":
        _same(_float(ins[2], "moe_route bias", 1).shape, (gate.shape[0],), "moe_route bias shape")
    else:
        raise IRError(f"moe_route mode {attrs['mode']!r} is not hash/topk")
    tok = _ints(ins[3], "moe_route tokens", 1)
    _same(tok.shape[0], y.shape[0], "moe_route token dim")
    if len(ins) == 6:
        if attrs["mode"] != "topk":
            raise IRError("moe_route: only top-k routing takes an image bias")
        _same(_float(ins[4], "moe_route bias_vl", 1).shape, (gate.shape[0],), "moe_route bias_vl shape")
        _same(_ints(ins[5], "moe_route image_index", 1).shape, tok.shape, "moe_route image_index shape")
    return [f32(y.shape[0], attrs["k"]), i32(y.shape[0], attrs["k"])]


@_op("experts", attrs=("limit", "quant"), arity=(6,))
def _experts(ins, attrs):
    y = _float(ins[0], "experts input", 2)
    weights = _float(ins[1], "experts routing weights", 2)
    ids = _ints(ins[2], "experts ids", 2)
    _same(weights.shape, ids.shape, "experts weights vs ids")
    w1, w2, w3 = (_float(v, "expert weight", 3) for v in ins[3:])
    _same(w1.shape, w3.shape, "expert w1 vs w3")
    _same(w1.shape[2], y.shape[1], "expert w1 width")
    _same(w2.shape, (w1.shape[0], w1.shape[2], w1.shape[1]), "expert w2 shape")
    return [y]


@_op("shared_expert", attrs=("limit", "quant"), arity=(4,))
def _shared_expert(ins, attrs):
    y = _float(ins[0], "shared_expert input", 2)
    w1, w2, w3 = (_float(v, "shared expert weight", 2) for v in ins[1:])
    _same(w1.shape, w3.shape, "shared expert w1 vs w3")
    _same(w2.shape, (w1.shape[1], w1.shape[0]), "shared expert w2 shape")
    _same(w1.shape[1], y.shape[1], "shared expert width")
    return [y]


# ----------------------------------------------------------------------------- DeepSeek-V4.1
# (frontend.trace_v41; docs/v41.md)


@_op("mhc_mix", attrs=("hc_mult", "sinkhorn_iters", "hc_eps", "norm_eps"), arity=(4,))
def _mhc_mix(ins, attrs):
    """A site's mixes from its input streams: (pre, post, comb). V4.1 collapses the *next*
    site's input with this ``pre`` (delayed pre), so the collapse is an op of its own."""
    _, post, comb = _mhc_pre(ins, attrs)
    return [f32(*post.shape), post, comb]  # pre is per token and stream, as post


@_op("hc_collapse", arity=(1, 2))
def _hc_collapse(ins, attrs):
    """``sum_j pre[j] * h[j]``; without ``pre``, stream 0 (the first site of the model)."""
    h = _float(ins[0], "hc_collapse streams", 3)
    if len(ins) == 2:
        _same(_float(ins[1], "hc_collapse pre", 2).shape, h.shape[:2], "hc_collapse pre shape")
    return [f32(h.shape[0], h.shape[2])]


@_op("v41_roundtrip", attrs=("format",), arity=(1,))
def _v41_rt(ins, attrs):
    """V4.1's always-on activation round trip (artifact.lowbit.v41_roundtrip)."""
    from dsv4c.artifact.lowbit import V41_ROUNDTRIPS

    if attrs["format"] not in V41_ROUNDTRIPS:
        raise IRError(f"v41_roundtrip format {attrs['format']!r} is not one of {', '.join(V41_ROUNDTRIPS)}")
    return [_float(ins[0], "v41_roundtrip input")]


@_op("shared_compress", attrs=("layer", "ratio", "head_dim", "index_dim", "rope_dim", "eps", "index_keys",
                                "fake_quant", "quant"),
     effect=True, arity=(4, 5, 6, 7))
def _shared_compress(ins, attrs):
    """A V4.1 KV source's compressor: ``[kv, norm, positions, seq_ids]``, then the gate when the
    ratio pools several tokens, then ``[wk, k_norm]`` when it makes its group's index keys.
    Every window the step closes becomes a row of the group (softmax-gated pool, rmsnorm, rope
    at its first position, FP4 round trip where ``fake_quant``) and, from the same latent, an
    index key (wk, k_norm, rope, FP4 round trip)."""
    kv = _float(ins[0], "shared_compress kv", 2)
    _same(kv.shape[1], attrs["head_dim"], "shared_compress kv width")
    _same(_float(ins[1], "shared_compress norm", 1).shape, (attrs["head_dim"],), "shared_compress norm shape")
    _same(kv.shape[0], _token_meta(ins, 2, "shared_compress"), "shared_compress token dim")
    gated = attrs["ratio"] > 1
    want = 4 + gated + 2 * bool(attrs["index_keys"])
    if len(ins) != want:
        raise IRError(f"shared_compress of ratio {attrs['ratio']} with index_keys={attrs['index_keys']} takes "
                      f"{want} inputs, got {len(ins)}")
    if gated:
        _same(_float(ins[4], "shared_compress gate", 2).shape, kv.shape, "shared_compress gate shape")
    if attrs["index_keys"]:
        _same(_float(ins[-2], "shared_compress wk", 2).shape, (attrs["index_dim"], attrs["head_dim"]),
              "shared_compress wk shape")
        _same(_float(ins[-1], "shared_compress k_norm", 1).shape, (attrs["index_dim"],), "shared_compress k_norm")
    return [STATE]


@_op("candidate_mask", attrs=("ratio", "block", "blocks"), arity=(3,))
def _candidate_mask(ins, attrs):
    """The first level of the two-level top-k: from a candidate source's index scores ``[T, E]``
    (invisible rows -inf), 0 on the rows of each query's ``blocks`` best blocks of ``block``
    rows (a block scores its best row; the block of the newest visible row always kept), -inf
    elsewhere."""
    s = _float(ins[0], "candidate_mask scores", 2)
    _same(s.shape[0], _token_meta(ins, 1, "candidate_mask"), "candidate_mask token dim")
    return [s]


@_op("image_splice", arity=(3,))
def _image_splice(ins, attrs):
    """``[x, image_index, image_rows]``: ``x`` with token t's row replaced by
    ``image_rows[image_index[t]]`` where that is >= 0 (an image span's positions, V4.1)."""
    x = _float(ins[0], "image_splice input", 2)
    _same(_ints(ins[1], "image_splice image_index", 1).shape, x.shape[:1], "image_splice token dim")
    _same(_float(ins[2], "image_splice image_rows", 2).shape[1], x.shape[1], "image_splice row width")
    return [x]


@_op("engram", attrs=("slot", "eps", "quant"), arity=(6,))
def _engram(ins, attrs):
    """An Engram layer's lookup and gate: the table rows ``ids[:, slot]`` ``[T, L_e, C]`` of each
    token, projected by ``wkv`` to one key per stream and a value, gated into the streams."""
    h = _float(ins[0], "engram streams", 3)
    ids = _ints(ins[1], "engram row ids", 3)
    table = _float(ins[2], "engram table", 2)
    wkv = _float(ins[3], "engram wkv", 2)
    t, n, d = h.shape
    _same(ids.shape[0], t, "engram token dim")
    if all(isinstance(v, int) for v in (n, d, ids.shape[2], table.shape[1])):
        _same(wkv.shape, ((n + 1) * d, ids.shape[2] * table.shape[1]), "engram wkv shape")
    for v in ins[4:]:
        _same(_float(v, "engram q/k weight", 2).shape, (n, d), "engram q/k weight shape")
    return [h]


# ----------------------------------------------------------------------------- tensor parallel
# (frontend.trace traces them for N > 1 ranks; docs/tensor_parallel.md)


@_op("shard_ids", attrs=("size",), arity=(2,))
def _shard_ids(ins, attrs):
    """Global ids (vocab rows, experts) -> this rank's: ``id - first`` where that is in
    ``[0, size)``, else -1 (another rank's)."""
    ids = _t(ins[0], "shard_ids ids")
    if ids.dtype != "i32":
        raise IRError(f"shard_ids ids must be i32, got {ids}")
    _same(_ints(ins[1], "shard_ids first", 1).shape, (1,), "shard_ids first shape")
    return [ids]


# Ops that join the ranks of a multi-rank step (``compile --tensor-parallel``).
COLLECTIVE_OPS = ("all_reduce", "all_gather")


@_op("all_reduce", arity=(1,))
def _all_reduce(ins, attrs):
    """The sum of every rank's ``x`` (each rank's partial product), on every rank."""
    return [_float(ins[0], "all_reduce input")]


@_op("all_gather", attrs=("size",), arity=(1,))
def _all_gather(ins, attrs):
    """``[n, cols]`` on each rank -> ``[n, size]``: the ranks' columns side by side in rank
    order, the first ``size`` kept (the last rank's padding dropped)."""
    x = _float(ins[0], "all_gather input", 2)
    return [f32(x.shape[0], attrs["size"])]


def infer_types(op: str, in_types: list[Type], attrs: dict[str, Any]) -> list[Type]:
    d = OPS.get(op)
    if d is None:
        raise IRError(f"unknown op {op!r}")
    missing = [a for a in d.attrs if a not in attrs]
    if missing:
        raise IRError(f"{op}: missing attribute {missing[0]!r}")
    if d.arity and len(in_types) not in d.arity:
        raise IRError(f"{op}: takes {' or '.join(map(str, d.arity))} inputs, got {len(in_types)}")
    return d.infer(in_types, attrs)
