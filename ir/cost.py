"""What an op costs: one rule per IR op, FLOPs and bytes moved for a decode step.

A rule takes a node and a :class:`Decode` (``batch`` requests each decoding one token with
``context`` tokens visible, the target's weight and pool row formats) and returns the node's
family and its :class:`Cost`. :func:`function_cost` sums a function's nodes by family; the
per-token numbers ``dsv4c inspect --cost`` prints divide them by the batch.

Counting conventions (``docs/cost_model.md``): a multiply-add is 2 FLOPs, any other arithmetic
or comparison 1, a transcendental (exp, rsqrt, sigmoid) 1. Bytes read count every tensor input
(activations fp32, weights in the format the target stores them, read once per step however
many tokens share it), the KV rows and compressor rings a node reads from the pool; bytes
written count its outputs and the rows it stores. Only the routed experts a step's tokens
select are read: with ``B`` tokens each picking ``k`` of ``E`` experts uniformly, ``E (1 -
(1 - k/E)^B)`` of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from dsv4c.artifact.model_config import Engram
from dsv4c.artifact.quant import FP32, dense_format, expert_format
from dsv4c.errors import UsageError
from dsv4c.ir.core import Function, Node, Value, concat_parts
from dsv4c.ir.types import TensorType

# Families in the order reports print them, with their titles.
FAMILIES = {
    "sliding_attention": "sliding attention",
    "csa_attention": "CSA sparse attention",
    "hca_attention": "HCA attention",
    "indexer": "indexer scoring",
    "topk": "top-k",
    "compressor": "compressor",
    "mhc": "mHC incl. Sinkhorn",
    "engram": "Engram lookup and gate",
    "routed_experts": "routed experts",
    "shared_experts": "shared experts",
    "dense_projections": "dense projections",
    "head": "embedding and head",
    "other": "norms, rope, adds, window writes",
}


@dataclass(frozen=True)
class Cost:
    flops: float = 0.0
    bytes_read: float = 0.0
    bytes_written: float = 0.0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.flops + other.flops, self.bytes_read + other.bytes_read,
                    self.bytes_written + other.bytes_written)

    def scaled(self, factor: float) -> "Cost":
        return Cost(self.flops * factor, self.bytes_read * factor, self.bytes_written * factor)


@dataclass(frozen=True)
class Decode:
    """One decode step: ``batch`` requests, one token each, each seeing ``context`` tokens
    (its own included), on a target storing main pool rows in ``main_row_bytes``, index rows in
    ``index_row_bytes`` and FP8 weights in ``fp8_format``."""

    batch: int
    context: int
    main_row_bytes: int
    index_row_bytes: int
    fp8_format: str = "e4m3fn"

    def __post_init__(self):
        if self.batch < 1 or self.context < 1:
            raise UsageError(f"a decode step needs batch >= 1 and context >= 1, got {self.batch} and {self.context}")

    def entries(self, ratio: int) -> int:
        """Compressed entries a token sees: windows of ``ratio`` tokens closed at its position."""
        return self.context // ratio


Rule = Callable[[Node, Decode], "tuple[str, Cost]"]
RULES: dict[str, Rule] = {}


def rule(*ops: str):
    def register(fn: Rule) -> Rule:
        for op in ops:
            RULES[op] = fn
        return fn

    return register


# --------------------------------------------------------------------------- sizes


def numel(v: Value, d: Decode, entries: int = 0) -> int:
    """Elements of a tensor value in this step: ``T`` is the batch, ``E`` the entries scored."""
    n = 1
    for dim in v.type.shape:
        n *= d.batch if dim == "T" else entries if dim == "E" else dim
    return n


def _tensor_bytes(values, d: Decode, entries: int = 0) -> float:
    """fp32 / int32 activations (every IR tensor is 4-byte)."""
    return sum(4 * numel(v, d, entries) for v in values if isinstance(v.type, TensorType))


def _io(node: Node, d: Decode, inputs: list[Value] | None = None, entries: int = 0) -> Cost:
    """Reading the node's tensor inputs (all of them unless named; weights other than matmul
    weights are stored fp32) and writing its outputs."""
    ins = node.inputs if inputs is None else inputs
    return Cost(0, _tensor_bytes(ins, d, entries), _tensor_bytes(node.outputs, d, entries))


def _dense_weight_bytes(node: Node, w: Value, d: Decode) -> float:
    return dense_format(node.attrs["quant"], d.fp8_format).nbytes(tuple(w.type.shape))


def _tokens(x: Value, d: Decode) -> int:
    """Rows a matmul multiplies: every dim but the last."""
    return numel(x, d) // x.type.shape[-1]


# --------------------------------------------------------------------------- families


def weight_family(name: str) -> str:
    """The family of a projection, by the official checkpoint name of its weight."""
    if "compressor." in name:  # the main compressor's and the indexer's own
        return "compressor"
    if "indexer." in name:
        return "indexer"
    if name == "head.weight" or ".markov_head." in name:  # DSpark's Markov head is a low-rank vocab head
        return "head"
    if "shared_experts." in name:
        return "shared_experts"
    return "dense_projections"


# --------------------------------------------------------------------------- rules


@rule("linear", "lm_head")
def _linear(node: Node, d: Decode):
    x, w = node.inputs
    out, inp = w.type.shape
    cost = Cost(2 * _tokens(x, d) * out * inp, _dense_weight_bytes(node, w, d)) + _io(node, d, [x])
    return weight_family(w.name), cost


def linear_split_parts(node: Node, d: Decode) -> list[tuple[str, Cost]]:
    """A merged projection's cost, part by part (each part's family is its own weight's)."""
    x, w = node.inputs
    names = concat_parts(w.name) or [w.name] * len(node.attrs["sizes"])
    fmt = dense_format(node.attrs["quant"], d.fp8_format)
    inp, tokens = w.type.shape[1], _tokens(x, d)
    share = _tensor_bytes([x], d) / len(names)  # the input is read once for all parts
    return [(weight_family(name), Cost(2 * tokens * rows * inp, fmt.nbytes((rows, inp)) + share,
                                       _tensor_bytes([out], d)))
            for name, rows, out in zip(names, node.attrs["sizes"], node.outputs)]


@rule("grouped_linear")
def _grouped_linear(node: Node, d: Decode):
    x, w = node.inputs
    rows, cols = w.type.shape
    return "dense_projections", Cost(2 * d.batch * rows * cols, _dense_weight_bytes(node, w, d)) + _io(node, d, [x])


@rule("embed")
def _embed(node: Node, d: Decode):
    # One table row per token, not the table.
    row = node.inputs[1].type.shape[1]
    return "head", Cost(0, 4 * d.batch * (row + 1), _tensor_bytes(node.outputs, d))


@rule("image_splice")
def _image_splice(node: Node, d: Decode):
    # Decode steps carry no image positions: the compiled decode step does not splice.
    return "head", Cost()


def _mhc_pre_cost(h: Value, fn: Value, attrs: dict, d: Decode, collapse: bool = True) -> Cost:
    t, n, dim = d.batch, h.type.shape[1], h.type.shape[2]
    mix = fn.type.shape[0]
    norm = 4 * n * dim  # unweighted rmsnorm of the flattened streams
    mixing = 2 * mix * n * dim
    gates = 4 * mix  # scale, bias, sigmoid / softmax terms per mixing coefficient
    sinkhorn = attrs.get("sinkhorn_iters", 0) * 2 * 2 * n * n  # a row and a column normalisation per iteration
    return Cost(t * (norm + mixing + gates + sinkhorn + (2 * n * dim if collapse else 0)))


def _mhc_post_cost(h: Value, d: Decode) -> Cost:
    n, dim = h.type.shape[1], h.type.shape[2]
    return Cost(d.batch * n * dim * (2 + 2 * n))  # post[k] * out + sum_j comb[j, k] h[j]


@rule("mhc_pre", "hc_head")
def _mhc_pre(node: Node, d: Decode):
    h, fn = node.inputs[:2]
    return "mhc", _mhc_pre_cost(h, fn, node.attrs, d) + _io(node, d)


@rule("mhc_mix")
def _mhc_mix(node: Node, d: Decode):
    h, fn = node.inputs[:2]
    return "mhc", _mhc_pre_cost(h, fn, node.attrs, d, collapse=False) + _io(node, d)


@rule("hc_collapse")
def _hc_collapse(node: Node, d: Decode):
    h = node.inputs[0]
    return "mhc", Cost(2 * numel(h, d) if len(node.inputs) == 2 else 0) + _io(node, d)


@rule("mhc_post")
def _mhc_post(node: Node, d: Decode):
    return "mhc", _mhc_post_cost(node.inputs[1], d) + _io(node, d)


@rule("mhc_seam", "mhc_post_head")
def _mhc_fused(node: Node, d: Decode):
    # One pass: the new streams are not read back, which the node's own inputs and outputs say.
    h, fn = node.inputs[1], node.inputs[4]
    return "mhc", _mhc_post_cost(h, d) + _mhc_pre_cost(h, fn, node.attrs, d) + _io(node, d)


@rule("hc_expand")
def _hc_expand(node: Node, d: Decode):
    return "mhc", _io(node, d)


@rule("hc_mean")
def _hc_mean(node: Node, d: Decode):
    return "mhc", Cost(numel(node.inputs[0], d)) + _io(node, d)  # an add per stream element, a scale


@rule("concat")
def _concat(node: Node, d: Decode):
    return "other", _io(node, d)  # a copy


def _rmsnorm_flops(x: Value, d: Decode, weighted: bool) -> int:
    return numel(x, d) * (4 if weighted else 3) + _tokens(x, d)  # square-add, scale (, weight); one rsqrt a row


def _rope_flops(x: Value, d: Decode, rope_dim: int) -> int:
    return _tokens(x, d) * 3 * rope_dim  # a rotation is 6 per channel pair (angles from a table)


@rule("rmsnorm")
def _rmsnorm(node: Node, d: Decode):
    return "other", Cost(_rmsnorm_flops(node.inputs[0], d, len(node.inputs) == 2)) + _io(node, d)


@rule("rope")
def _rope(node: Node, d: Decode):
    return "other", Cost(_rope_flops(node.inputs[0], d, node.attrs["rope_dim"])) + _io(node, d)


@rule("rmsnorm_rope")
def _rmsnorm_rope(node: Node, d: Decode):
    x = node.inputs[0]
    flops = _rmsnorm_flops(x, d, len(node.inputs) == 3) + _rope_flops(x, d, node.attrs["rope_dim"])
    return "other", Cost(flops) + _io(node, d)


@rule("add")
def _add(node: Node, d: Decode):
    return "other", Cost(numel(node.outputs[0], d)) + _io(node, d)


@rule("shard_ids", "all_reduce", "all_gather")
def _tensor_parallel(node: Node, d: Decode):
    # What a rank reads and writes; a collective's time on the wire is not modelled (one device).
    return "other", _io(node, d, [node.inputs[0]])


@rule("reshape")
def _reshape(node: Node, d: Decode):
    return "other", Cost()  # a view: no data moves


@rule("fp8_roundtrip", "fp4_roundtrip", "v41_roundtrip")
def _roundtrip(node: Node, d: Decode):
    return "other", Cost(4 * numel(node.inputs[0], d)) + _io(node, d)  # amax, scale, round, rescale


@rule("hadamard")
def _hadamard(node: Node, d: Decode):
    x = node.inputs[0]
    return "other", Cost(numel(x, d) * int(math.log2(x.type.shape[-1]))) + _io(node, d)


@rule("kv_write")
def _kv_write(node: Node, d: Decode):
    return "other", Cost(0, _tensor_bytes(node.inputs[:1], d), d.batch * d.main_row_bytes)


@rule("compress")
def _compress(node: Node, d: Decode):
    """Each token enters its ring (kv and gate, fp32); every ``ratio`` tokens a window closes: a
    softmax-weighted pool over its slots (2 ratio with overlap) per channel, rmsnorm and rope,
    one pool row stored. The closing is shared out over the ratio tokens that pay for it."""
    a = node.attrs
    r, hd = a["ratio"], a["head_dim"]
    slots = (2 if a["overlap"] else 1) * r
    row = d.main_row_bytes if a["stream"] == "main" else d.index_row_bytes
    pool = slots * hd * 6  # max, exp, sum, divide, multiply-add per slot and channel
    close = Cost(pool + 4 * hd + 3 * a["rope_dim"], 2 * 4 * slots * hd + 4 * numel(node.inputs[2], d) + 4 * hd, row)
    enter = Cost(0, _tensor_bytes(node.inputs[:2], d), _tensor_bytes(node.inputs[:2], d))
    return "compressor", enter + close.scaled(d.batch / r)


@rule("shared_compress")
def _shared_compress(node: Node, d: Decode):
    """A V4.1 KV source: each token enters its ring (kv and, above ratio 1, gate); every ``ratio``
    tokens a window closes: the gated pool (none at ratio 1), rmsnorm, rope and FP4 round trip of
    the group's row and, from the same latent, the index key (``wk``, rmsnorm, rope, FP4), both
    stored. The closing is shared out over the ratio tokens that pay for it."""
    a = node.attrs
    r, hd, di, rope = a["ratio"], a["head_dim"], a["index_dim"], a["rope_dim"]
    kv_in = [node.inputs[0]] + ([node.inputs[4]] if r > 1 else [])
    flops = (r * hd * 6 if r > 1 else 0) + 8 * hd + 3 * rope
    read, written = (2 * 4 * r * hd if r > 1 else 0) + 4 * hd, d.main_row_bytes
    if a["index_keys"]:
        flops += 2 * di * hd + 8 * di + 3 * rope
        read += _dense_weight_bytes(node, node.inputs[-2], d) + 4 * di
        written += d.index_row_bytes
    enter = Cost(0, _tensor_bytes(kv_in, d), _tensor_bytes(kv_in, d))
    return "compressor", enter + Cost(flops, read, written).scaled(d.batch / r)


@rule("candidate_mask")
def _candidate_mask(node: Node, d: Decode):
    """Block maxima over the scores, a selection of blocks, the mask written: about two operations
    a score."""
    entries = d.entries(node.attrs["ratio"])
    return "topk", Cost(2 * d.batch * entries) + _io(node, d, entries=entries)


@rule("engram")
def _engram(node: Node, d: Decode):
    """Each token's table rows (only those its n-grams hash to), projected by ``wkv`` into a key
    per stream and a value, then the per-stream gate."""
    h, ids, table, wkv = node.inputs[:4]
    rows = d.batch * ids.type.shape[1] * ids.type.shape[2]  # read per token, in the step's layer slot
    width = table.type.shape[1]
    n, dim = h.type.shape[1], h.type.shape[2]
    project = 2 * d.batch * ids.type.shape[2] * width * wkv.type.shape[0]
    gate = d.batch * n * dim * 8
    lookup = Cost(0, rows / ids.type.shape[1] * width * Engram.ELEMENT_BYTES + _dense_weight_bytes(node, wkv, d))
    return "engram", Cost(project + gate) + lookup + _io(node, d, [h, ids])


@rule("index_score")
def _index_score(node: Node, d: Decode):
    """Every visible index row against every index head: a dot, a relu, a weighted sum."""
    q = node.inputs[0]
    heads, dim = q.type.shape[1], q.type.shape[2]
    entries = d.entries(node.attrs["ratio"])
    per_entry = heads * (2 * dim + 1 + 2)
    flops = d.batch * entries * per_entry
    rows = d.batch * entries * d.index_row_bytes  # each request reads its own rows, once for all heads
    return "indexer", Cost(flops, rows) + _io(node, d, entries=entries)


@rule("index_topk")
def _index_topk(node: Node, d: Decode):
    """A selection over the scores: one comparison each (radix / heap selection, k << entries)."""
    scores = node.inputs[0].producer
    while scores.op == "add":  # V4.1: scores restricted to the candidate blocks
        scores = scores.inputs[0].producer
    entries = d.entries(scores.attrs["ratio"])
    return "topk", Cost(d.batch * entries) + _io(node, d, entries=entries)


def attention_rows(window: int, ratio: int, topk: int | None, d: Decode) -> tuple[int, int]:
    """(window rows, compressed rows) a query attends to: no compressed rows at ratio 0, else
    every visible one or (``topk``) the selected ones."""
    rows = min(window, d.context)
    if not ratio:
        return rows, 0
    return rows, d.entries(ratio) if topk is None else min(topk, d.entries(ratio))


def attention_cost(heads: int, key_dim: int, value_dim: int, rows: int, row_bytes: int, d: Decode) -> Cost:
    """A query's heads over ``rows`` shared KV rows (MQA: each row read once for all heads):
    scores, softmax, the weighted sum of values."""
    return Cost(d.batch * heads * rows * (2 * key_dim + 4 + 2 * value_dim), d.batch * rows * row_bytes)


@rule("sparse_attn")
def _sparse_attn(node: Node, d: Decode):
    a, q = node.attrs, node.inputs[0]
    heads, dim = q.type.shape[1], q.type.shape[2]
    topk = node.inputs[6].type.shape[1] if len(node.inputs) > 6 else None  # the index top-k input
    window, compressed = attention_rows(a["window"], a["ratio"], topk, d)
    cost = attention_cost(heads, dim, dim, window + compressed, d.main_row_bytes, d) + _io(node, d)
    # A draft block reads a window like a sliding layer (plus its own rows, which _io counts).
    return f"{'sliding' if a['kind'] == 'block' else a['kind']}_attention", cost


@rule("moe_route")
def _moe_route(node: Node, d: Decode):
    """Scores of every expert (gate @ y, sqrt-softplus), the top-k (or the hash table's row), weights."""
    y, gate, table = node.inputs[:3]
    experts, dim = gate.type.shape
    flops = d.batch * (2 * experts * dim + 3 * experts)
    table_bytes = 4 * d.batch * table.type.shape[1] if node.attrs["mode"] == "hash" else 4 * experts
    return "routed_experts", Cost(flops, FP32.nbytes((experts, dim)) + table_bytes) + _io(node, d, [y])


def swiglu_flops(inter: int, dim: int) -> int:
    """One token through one SwiGLU expert: three matmuls, the clamped gate."""
    return 3 * 2 * inter * dim + 6 * inter


def experts_touched(experts: int, k: int, tokens: int) -> float:
    return experts * (1 - (1 - k / experts) ** tokens)


def experts_cost(node: Node, d: Decode, fmt) -> Cost:
    """The routed experts of a step with their weights stored in ``fmt``: each token's k experts,
    the weights of every expert some token selected."""
    ids, w1 = node.inputs[2], node.inputs[3]
    e, inter, dim = w1.type.shape
    k = ids.type.shape[1]
    per_expert = 2 * fmt.nbytes((inter, dim)) + fmt.nbytes((dim, inter))
    flops = d.batch * k * (swiglu_flops(inter, dim) + 2 * dim)  # + the weighted combine
    return Cost(flops, experts_touched(e, k, d.batch) * per_expert) + _io(node, d, node.inputs[:3])


@rule("experts")
def _experts(node: Node, d: Decode):
    return "routed_experts", experts_cost(node, d, expert_format(node.attrs["quant"]))


@rule("shared_expert")
def _shared_expert(node: Node, d: Decode):
    y, w1, w2, w3 = node.inputs
    inter, dim = w1.type.shape
    weights = sum(_dense_weight_bytes(node, w, d) for w in (w1, w2, w3))
    return weight_family(w1.name), Cost(d.batch * swiglu_flops(inter, dim), weights) + _io(node, d, [y])


# --------------------------------------------------------------------------- sums


def node_costs(node: Node, d: Decode, rules: dict[str, Rule] | None = None) -> list[tuple[str, Cost]]:
    """A node's cost by family (a merged projection has one entry per part)."""
    if node.op == "linear_split":
        return linear_split_parts(node, d)
    rules = RULES if rules is None else rules
    if node.op not in rules:
        raise UsageError(f"no cost rule for op {node.op!r}")
    return [rules[node.op](node, d)]


def node_families(node: Node) -> dict[str, float]:
    """Each family's share of a node's work: one family, or a merged projection's parts by the
    bytes they read (weights of the same format and width, so by their rows). A profile splits
    the time of the node's kernel calls so."""
    parts = node_costs(node, Decode(1, 1, 4, 4))
    read = sum(c.bytes_read for _, c in parts)
    out: dict[str, float] = {}
    for family, c in parts:
        out[family] = out.get(family, 0.0) + (c.bytes_read / read if len(parts) > 1 else 1.0)
    return out


def function_cost(fn: Function, d: Decode, rules: dict[str, Rule] | None = None) -> dict[str, Cost]:
    """The step's cost by family (every family present, in :data:`FAMILIES` order), for the
    whole batch."""
    out = {f: Cost() for f in FAMILIES}
    for node in fn.nodes:
        for family, cost in node_costs(node, d, rules):
            out[family] = out[family] + cost
    return out


def total(costs: dict[str, Cost]) -> Cost:
    return sum(costs.values(), Cost())
