"""DeepSeek-V3.2-Exp as a cost-model preset: the model V4's report compares itself with.

dsv4c never compiles V3.2; ``dsv4c inspect v3.2 --cost`` costs its decode step with the same
rules as V4 (``ir.cost``) wherever the op is the same: projections, the MoE, the lightning
indexer's scoring (over every token: ratio 1) and its top-k, norms, rope, the head. What V4
does not have gets its own rule here: MLA's attention in its absorbed form (the per-head
``W_UK`` / ``W_UV`` products are grouped projections; the core attends each head's 576-wide
query over the top-k 576-wide latent rows and sums 512-wide values). V3.2's FP8 routed experts
are costed in FP8 (dsv4c's own kernels would dequantize non-FP4 experts to fp32).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

from dsv4c.artifact.pool_rows import index_row_bytes_of
from dsv4c.artifact.quant import dense_format
from dsv4c.errors import ConfigError
from dsv4c.ir.core import Builder, Function, Node, Value
from dsv4c.ir.cost import RULES, Cost, Decode, attention_cost, experts_cost, function_cost, numel
from dsv4c.ir.ops import f32, i32
from dsv4c.ir.types import STATE

NAME = "v3.2"
FP8_GROUP = 128  # FlashMLA's FP8 latent rows: one fp32 scale per 128 values
NO_CLAMP = float("inf")  # V3's SwiGLU has no limit


@dataclass(frozen=True)
class V32Config:
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_layers: int
    first_k_dense_replace: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_experts_per_tok: int
    routed_scaling_factor: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    vocab_size: int
    rms_norm_eps: float
    name: str = NAME


def v32_preset() -> V32Config:
    raw = json.loads(resources.files("dsv4c.frontend").joinpath(f"presets/{NAME}.json").read_text())
    fields = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "nope_dim": "qk_nope_head_dim",
              "rope_dim": "qk_rope_head_dim", "n_experts_per_tok": "num_experts_per_tok"}
    try:
        return V32Config(**{f: raw[fields.get(f, f)] for f in V32Config.__dataclass_fields__ if f != "name"})
    except KeyError as e:
        raise ConfigError(f"presets/{NAME}.json lacks {e}") from None


def latent_row_bytes(cfg: V32Config, storage: str) -> int:
    """One MLA cache row: the latent and its rope key. FP8 as FlashMLA stores it (e4m3 latent,
    an fp32 scale per 128, BF16 rope: 656 B); otherwise every value in ``storage``."""
    if storage == "fp8":
        return cfg.kv_lora_rank + 4 * (cfg.kv_lora_rank // FP8_GROUP) + 2 * cfg.rope_dim
    return (cfg.kv_lora_rank + cfg.rope_dim) * {"bf16": 2, "fp32": 4}[storage]


def v32_decode(cfg: V32Config, batch: int, context: int, main_storage: str, index_storage: str,
               fp8_format: str) -> Decode:
    """A decode step of V3.2 with its cache rows in the storage a target's plan gives V4's."""
    return Decode(batch, context, latent_row_bytes(cfg, main_storage),
                  index_row_bytes_of(cfg.index_head_dim, index_storage), fp8_format)


def kv_bytes_per_token(cfg: V32Config, d: Decode) -> int:
    """Every layer keeps one latent row and one index key row per token."""
    return cfg.num_layers * (d.main_row_bytes + d.index_row_bytes)


# --------------------------------------------------------------------------- the decode step


def _mla_sparse_attn(node: Node, d: Decode):
    """Each head's latent + rope query against the top-k latent rows (DSA keeps no window)."""
    q_latent, q_rope = node.inputs[:2]
    h, latent = q_latent.type.shape[1:]
    rows = min(node.attrs["topk"], d.context)
    cost = attention_cost(h, latent + q_rope.type.shape[2], latent, rows, d.main_row_bytes, d)
    return "csa_attention", cost + Cost(0, 4 * (numel(q_latent, d) + numel(q_rope, d)), 4 * numel(node.outputs[0], d))


def _fp8_experts(node: Node, d: Decode):
    return "routed_experts", experts_cost(node, d, dense_format(node.attrs["quant"], d.fp8_format))


V32_RULES = {**RULES, "mla_sparse_attn": _mla_sparse_attn, "experts": _fp8_experts}


class _Trace:
    def __init__(self, cfg: V32Config):
        self.cfg, self.fn = cfg, Function("step")
        self.b = Builder(self.fn)

    def linear(self, x: Value, name: str, out: int, inp: int, quant: str = "fp8_b128") -> Value:
        return self.b.emit("linear", [x, self.b.weight(name, f32(out, inp))], {"quant": quant}, name)

    def norm(self, x: Value, name: str, size: int) -> Value:
        return self.b.emit("rmsnorm", [x, self.b.weight(name, f32(size))], {"eps": self.cfg.rms_norm_eps}, name)

    def rope(self, x: Value, pos: Value, hint: str) -> Value:
        return self.b.emit("rope", [x, pos], {"rope": "main", "rope_dim": self.cfg.rope_dim, "inverse": False}, hint)

    def attention(self, layer: int, p: str, x: Value, pos: Value, seq: Value) -> Value:
        c, b = self.cfg, self.b
        h, latent = c.num_heads, c.kv_lora_rank
        q_res = self.norm(self.linear(x, f"{p}wq_a.weight", c.q_lora_rank, c.hidden_size), f"{p}q_norm.weight",
                          c.q_lora_rank)
        # wq_b's NoPE and rope rows as two projections (one GEMM in the model: the same cost).
        q_nope = b.emit("reshape", [self.linear(q_res, f"{p}wq_b.nope", h * c.nope_dim, c.q_lora_rank)],
                        {"shape": ["T", h, c.nope_dim]}, f"{p}q_nope")
        q_rope = b.emit("reshape", [self.linear(q_res, f"{p}wq_b.rope", h * c.rope_dim, c.q_lora_rank)],
                        {"shape": ["T", h, c.rope_dim]}, f"{p}q_rope_heads")
        q_rope = self.rope(q_rope, pos, f"{p}q_rope")
        # The latent row's norm covers its rope channels here too: 64 values a token more.
        kv = self.norm(self.linear(x, f"{p}wkv_a.weight", latent + c.rope_dim, c.hidden_size),
                       f"{p}kv_norm.weight", latent + c.rope_dim)
        kv = self.rope(kv, pos, f"{p}kv")
        b.emit("kv_write", [kv, pos, seq], {"layer": layer, "window": 0}, f"{p}latent_row")
        # Absorbed MLA: each head's NoPE query through its W_UK slice into the latent space.
        q_latent = b.emit("grouped_linear", [q_nope, b.weight(f"{p}wkv_b.uk", f32(h * latent, c.nope_dim))],
                          {"groups": h, "quant": "fp8_b128"}, f"{p}q_latent")
        topk = self.indexer(layer, p, x, q_res, pos, seq)
        attn = Node("mla_sparse_attn", [q_latent, q_rope, topk], {"topk": c.index_topk}, [])
        attn.outputs = [Value(f"{p}o_latent", f32("T", h, latent), "node", attn)]
        b.fn.nodes.append(attn)
        o = b.emit("grouped_linear", [attn.outputs[0], b.weight(f"{p}wkv_b.uv", f32(h * c.v_head_dim, latent))],
                   {"groups": h, "quant": "fp8_b128"}, f"{p}o_heads")
        o = b.emit("reshape", [o], {"shape": ["T", h * c.v_head_dim]}, f"{p}o_flat")
        return self.linear(o, f"{p}wo.weight", c.hidden_size, h * c.v_head_dim)

    def indexer(self, layer: int, p: str, x: Value, q_res: Value, pos: Value, seq: Value) -> Value:
        c, b = self.cfg, self.b
        hi, di = c.index_n_heads, c.index_head_dim
        q = self.linear(q_res, f"{p}indexer.wq_b.weight", hi * di, c.q_lora_rank)
        q = b.emit("reshape", [q], {"shape": ["T", hi, di]}, f"{p}indexer.q_heads")
        q = b.emit("hadamard", [self.rope(q, pos, f"{p}indexer.q_rope")], {}, f"{p}indexer.q_rot")
        k = self.norm(self.linear(x, f"{p}indexer.wk.weight", di, c.hidden_size), f"{p}indexer.k_norm.weight", di)
        k = b.emit("hadamard", [self.rope(k, pos, f"{p}indexer.k_rope")], {}, f"{p}indexer.k_rot")
        weights = self.linear(x, f"{p}indexer.weights_proj.weight", hi, c.hidden_size, "bf16")
        keys = Value(f"{p}indexer.keys", STATE, "node")  # its cache: one index row per token (ratio 1)
        scores = b.emit("index_score", [q, weights, pos, seq, keys], {"layer": layer, "ratio": 1}, f"{p}indexer.scores")
        return b.emit("index_topk", [scores], {"k": c.index_topk}, f"{p}indexer.topk")

    def ffn(self, p: str, layer: int, x: Value, tokens: Value) -> Value:
        c, b = self.cfg, self.b
        d = c.hidden_size

        def mlp(prefix: str, inter: int) -> Value:
            ws = [b.weight(f"{prefix}{w}.weight", f32(*shape)) for w, shape in
                  (("w1", (inter, d)), ("w2", (d, inter)), ("w3", (inter, d)))]
            return b.emit("shared_expert", [x] + ws, {"limit": NO_CLAMP, "quant": "fp8_b128"}, f"{prefix}out")

        if layer < c.first_k_dense_replace:
            return mlp(f"{p}mlp.", c.intermediate_size)
        e, k, inter = c.n_routed_experts, c.n_experts_per_tok, c.moe_intermediate_size
        gate, bias = b.weight(f"{p}mlp.gate.weight", f32(e, d)), b.weight(f"{p}mlp.gate.bias", f32(e))
        weights, ids = b.emit("moe_route", [x, gate, bias, tokens], {"mode": "topk", "k": k, "scale": c.routed_scaling_factor},
                              [f"{p}route_w", f"{p}route_ids"])
        ex = [b.weight(f"{p}mlp.experts.{w}", f32(e, *shape)) for w, shape in
              (("w1", (inter, d)), ("w2", (d, inter)), ("w3", (inter, d)))]
        routed = b.emit("experts", [x, weights, ids] + ex, {"limit": NO_CLAMP, "quant": "fp8_b128"}, f"{p}routed")
        return b.emit("add", [routed, mlp(f"{p}mlp.shared_experts.", inter)], {}, f"{p}moe_out")


def v32_step(cfg: V32Config) -> Function:
    """V3.2's decode step as IR nodes (plain residuals, MLA with the DSA indexer, MoE), costed by
    :data:`V32_RULES`; built for costing only, never verified or compiled."""
    t = _Trace(cfg)
    b, d = t.b, cfg.hidden_size
    tokens, pos, seq = b.input("tokens", i32("T")), b.input("positions", i32("T")), b.input("seq_ids", i32("T"))
    x = b.emit("embed", [tokens, b.weight("embed.weight", f32(cfg.vocab_size, d))], {}, "x")
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        x = b.emit("add", [x, t.attention(i, f"{p}attn.", t.norm(x, f"{p}attn_norm.weight", d), pos, seq)], {}, f"{p}h")
        x = b.emit("add", [x, t.ffn(p, i, t.norm(x, f"{p}ffn_norm.weight", d), tokens)], {}, f"{p}out")
    y = t.norm(x, "norm.weight", d)
    fn = t.fn
    fn.outputs = [b.emit("lm_head", [y, b.weight("head.weight", f32(cfg.vocab_size, d))], {"quant": "bf16"}, "logits")]
    return fn


def v32_cost(cfg: V32Config, d: Decode) -> dict[str, Cost]:
    return function_cost(v32_step(cfg), d, V32_RULES)
