"""Trace a model description into the dsv4c IR (docs/v4.md, "Forward pass").

The model reads top-down like an MLC-LLM model definition: ``Block`` = two mHC seams around
attention and MoE; ``Attention`` builds the compressor and indexer the layer's roles give it.
Weight names are the official checkpoint names (``layers.3.attn.wq_a.weight``); routed
experts appear as one stacked logical weight per projection (``layers.3.ffn.experts.w1``,
``[E, I, D]``) that the weight loader assembles from the per-expert tensors.

The traced ``step`` function runs T tokens of any number of requests: token ``t`` belongs
to request ``seq_ids[t]`` at absolute position ``positions[t]``.

Traced for ``tensor_parallel`` N > 1, the program is what every one of N ranks runs
(docs/tensor_parallel.md): each weight has the shape of one rank's part under the sharding plan
(``artifact.sharding``; the same on every rank, the last vocab part padded), head, group, expert
and intermediate counts are the local ones, and collectives join the parts: ``all_reduce`` after
the attention output projection, after routed + shared experts and after the vocab-split
embedding, ``all_gather`` of the head's vocab columns. Which vocab rows and experts a rank
holds is data, not structure (``artifact.sharding.RANK_VALUES``, one int each per rank, read by
``shard_ids``), so one compiled library serves every rank.
"""

from __future__ import annotations

import sys

from dsv4c.artifact.model_config import HASH_MOE, LayerSpec, ModelConfig
from dsv4c.artifact.quant import checkpoint_quants, traced_numerics
from dsv4c.artifact.sharding import EXPERT_FIRST, VOCAB_FIRST, ShardingPlan
from dsv4c.errors import UnsupportedModelError, UsageError
from dsv4c.frontend.trace_dspark import DsparkFunctions
from dsv4c.frontend.trace_v41 import V41Functions
from dsv4c.ir.core import Builder, Function, Program, Value
from dsv4c.ir.ops import f32, i32

NUMERICS = ("exact", "qat")


class Model(DsparkFunctions, V41Functions):
    """Emits the step and MTP (or DSpark drafter) programs of one configuration."""

    def __init__(self, cfg: ModelConfig, numerics: str = "exact", tensor_parallel: int = 1,
                 expert_parallel: bool = True):
        if cfg.family == "v4.1" and numerics != "exact":
            # Its fake-quant round trips are part of the model: there is no other numerics to choose.
            raise UnsupportedModelError(f"{cfg.name}: DeepSeek-V4.1 is traced with numerics 'exact' only "
                                        "(its KV fake-quant is always on)")
        self.plan = ShardingPlan.build(cfg, tensor_parallel, expert_parallel)
        self.tp = tensor_parallel
        if numerics not in NUMERICS:
            raise UsageError(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
        self.cfg, self.numerics = cfg, numerics
        # A multi-rank artifact has no drafter yet (docs/tensor_parallel.md).
        self.traces_dspark = cfg.dspark is not None and tensor_parallel == 1
        other = next((l for l in cfg.layers + cfg.mtp_layers if not l.is_v4), None)
        if other is not None and cfg.family != "v4.1":
            raise UnsupportedModelError(f"layer {other.index}: shared compressed KV, reused top-k and Engram "
                                        "layers are not implemented by dsv4c's trace")
        if numerics == "qat":
            d_i = cfg.index_head_dim
            if cfg.nope_dim % 64 or d_i % 32 or d_i & (d_i - 1):
                raise UnsupportedModelError(
                    f"qat numerics need head_dim - qk_rope_head_dim divisible by 64 (got {cfg.nope_dim}) and a "
                    f"power-of-two index_head_dim divisible by 32 (got {d_i}), as the official FP8/FP4 blocks do"
                )
        # The storage format each projection arrives in; the quantization plan says how a target stores it.
        quants = checkpoint_quants(cfg.weights)
        self.dense_quant, self.expert_quant, self.bf16_quant = quants["dense"], quants["expert"], quants["bf16"]

    # ------------------------------------------------------------------ helpers
    def _w(self, b: Builder, name: str, *shape: int) -> Value:
        """Weight ``name`` of full ``shape``, as one rank holds it (all of it on one device)."""
        return b.weight(name, f32(*self.plan.shard(name, shape, 0).held_shape(shape)))

    def _local(self, count: int) -> int:
        """A head / group / expert / intermediate count split across the ranks (the plan checked it divides)."""
        return count // self.tp

    def _reduce(self, b: Builder, x: Value, hint: str) -> Value:
        """The sum over ranks of each rank's partial ``x``: nothing to add on one device."""
        return b.emit("all_reduce", [x], {}, f"{hint}.reduced") if self.tp > 1 else x

    def _embed(self, b: Builder, tokens: Value, hint: str) -> Value:
        """Token embeddings; across ranks each looks up the ids in its vocab rows (zeros for the
        others') and the sum is every token's row."""
        c = self.cfg
        table = self._w(b, "embed.weight", c.vocab_size, c.hidden_size)
        if self.tp == 1:
            return b.emit("embed", [tokens, table], {}, hint)
        rows = b.emit("shard_ids", [tokens, b.weight(VOCAB_FIRST, i32(1))], {"size": table.type.shape[0]},
                      f"{hint}.rows")
        return self._reduce(b, b.emit("embed", [rows, table], {}, hint), hint)

    def _linear(self, b: Builder, x: Value, name: str, out: int, inp: int, quant: str, hint: str) -> Value:
        return b.emit("linear", [x, self._w(b, name, out, inp)], {"quant": quant}, hint)

    def _norm(self, b: Builder, x: Value, weight: str | None, size: int, hint: str) -> Value:
        ins = [x] if weight is None else [x, self._w(b, weight, size)]
        return b.emit("rmsnorm", ins, {"eps": self.cfg.rms_norm_eps}, hint)

    def _hc_attrs(self) -> dict:
        c = self.cfg
        return {"hc_mult": c.hc_mult, "sinkhorn_iters": c.hc_sinkhorn_iters, "hc_eps": c.hc_eps,
                "norm_eps": c.rms_norm_eps}

    # ------------------------------------------------------------------ blocks
    def seam(self, b: Builder, h: Value, prefix: str, which: str, hint: str):
        c = self.cfg
        n, d = c.hc_mult, c.hidden_size
        fn = self._w(b, f"{prefix}hc_{which}_fn", c.hc_mix_size, n * d)
        base = self._w(b, f"{prefix}hc_{which}_base", c.hc_mix_size)
        scale = self._w(b, f"{prefix}hc_{which}_scale", 3)
        return b.emit("mhc_pre", [h, fn, base, scale], self._hc_attrs(),
                      [f"{hint}.{which}_in", f"{hint}.{which}_post", f"{hint}.{which}_comb"])

    def block(self, b: Builder, layer: LayerSpec, prefix: str, h: Value, tokens: Value, pos: Value, seq: Value,
              draft: bool = False):
        """One layer; ``draft``: a DSpark stage over a draft block (attention of kind ``block``)."""
        c, tag = self.cfg, f"l{layer.index}"
        y, post, comb = self.seam(b, h, prefix, "attn", tag)
        y = self._norm(b, y, f"{prefix}attn_norm.weight", c.hidden_size, f"{tag}.attn_x")
        out = self.attention(b, layer, prefix, y, pos, seq, draft)
        h = b.emit("mhc_post", [out, h, post, comb], {}, f"{tag}.h_attn")
        y, post, comb = self.seam(b, h, prefix, "ffn", tag)
        y = self._norm(b, y, f"{prefix}ffn_norm.weight", c.hidden_size, f"{tag}.ffn_x")
        out = self.moe(b, layer, prefix, y, tokens)
        return b.emit("mhc_post", [out, h, post, comb], {}, f"{tag}.h")

    def compressor(self, b: Builder, layer: LayerSpec, prefix: str, x: Value, pos: Value, seq: Value,
                   stream: str, head_dim: int) -> Value:
        """The gated pooling compressor of a KV source or of its index keys: returns the state
        token after this step's entries are written."""
        c, tag = self.cfg, f"l{layer.index}.{stream}"
        overlap = layer.overlap
        width = (2 if overlap else 1) * head_dim
        kv = self._linear(b, x, f"{prefix}wkv.weight", width, c.hidden_size, self.bf16_quant, f"{tag}.ckv")
        gate = self._linear(b, x, f"{prefix}wgate.weight", width, c.hidden_size, self.bf16_quant, f"{tag}.cgate")
        ape = self._w(b, f"{prefix}ape", layer.compress_ratio, width)
        norm = self._w(b, f"{prefix}norm.weight", head_dim)
        quant = "none"
        if self.numerics == "qat":
            quant = "fp8" if stream == "main" else "hadamard_fp4"
        attrs = {"layer": layer.index, "stream": stream, "ratio": layer.compress_ratio, "overlap": overlap,
                 "head_dim": head_dim, "rope_dim": c.rope_dim, "entry_quant": quant, "eps": c.rms_norm_eps}
        return b.emit("compress", [kv, gate, ape, norm, pos, seq], attrs, f"{tag}.entries")

    def indexer(self, b: Builder, layer: LayerSpec, prefix: str, x: Value, q_res: Value, pos: Value,
                seq: Value) -> Value:
        c, tag = self.cfg, f"l{layer.index}.index"
        hi, di = c.index_n_heads, c.index_head_dim
        state = self.compressor(b, layer, f"{prefix}indexer.compressor.", x, pos, seq, "index", di)
        q = self._linear(b, q_res, f"{prefix}indexer.wq_b.weight", hi * di, c.q_lora_rank, self.dense_quant,
                         f"{tag}.q")
        q = b.emit("reshape", [q], {"shape": ["T", hi, di]}, f"{tag}.q_heads")
        q = b.emit("rope", [q, pos], {"rope": "compress", "rope_dim": c.rope_dim, "inverse": False}, f"{tag}.q_rope")
        if self.numerics == "qat":
            q = b.emit("hadamard", [q], {}, f"{tag}.q_rot")
            q = b.emit("fp4_roundtrip", [q], {"block": 32}, f"{tag}.q_fp4")
        weights = self._linear(b, x, f"{prefix}indexer.weights_proj.weight", hi, c.hidden_size, self.bf16_quant,
                               f"{tag}.w")
        scores = b.emit("index_score", [q, weights, pos, seq, state], {"layer": layer.index,
                                                                      "ratio": layer.compress_ratio},
                        f"{tag}.scores")
        return b.emit("index_topk", [scores], {"k": c.index_topk}, f"{tag}.topk")

    def window_kv(self, b: Builder, x: Value, prefix: str, rope: dict, pos: Value, tag: str) -> Value:
        """The window KV row of each token: ``wkv``, ``kv_norm``, rope (and the FP8 row format under qat)."""
        c = self.cfg
        kv = self._linear(b, x, f"{prefix}wkv.weight", c.head_dim, c.hidden_size, self.dense_quant, f"{tag}.kv_a")
        kv = self._norm(b, kv, f"{prefix}kv_norm.weight", c.head_dim, f"{tag}.kv_normed")
        kv = b.emit("rope", [kv, pos], {**rope, "inverse": False}, f"{tag}.kv")
        if self.numerics == "qat":
            kv = b.emit("fp8_roundtrip", [kv], {"block": 64, "channels": c.nope_dim}, f"{tag}.kv_fp8")
        return kv

    def attention(self, b: Builder, layer: LayerSpec, prefix: str, x: Value, pos: Value, seq: Value,
                  draft: bool = False) -> Value:
        c, tag = self.cfg, f"l{layer.index}"
        p = f"{prefix}attn."
        rope = {"rope": "compress" if layer.is_compressed else "main", "rope_dim": c.rope_dim}
        q_res = self._linear(b, x, f"{p}wq_a.weight", c.q_lora_rank, c.hidden_size, self.dense_quant, f"{tag}.q_a")
        q_res = self._norm(b, q_res, f"{p}q_norm.weight", c.q_lora_rank, f"{tag}.q_res")
        heads = self._local(c.num_heads)
        q = self._linear(b, q_res, f"{p}wq_b.weight", c.num_heads * c.head_dim, c.q_lora_rank, self.dense_quant,
                         f"{tag}.q")
        q = b.emit("reshape", [q], {"shape": ["T", heads, c.head_dim]}, f"{tag}.q_heads")
        q = self._norm(b, q, None, c.head_dim, f"{tag}.q_normed")
        q = b.emit("rope", [q, pos], {**rope, "inverse": False}, f"{tag}.q_rope")
        kv = self.window_kv(b, x, p, rope, pos, tag)

        compressed = []
        if layer.is_kv_source:
            compressed.append(self.compressor(b, layer, f"{p}compressor.", x, pos, seq, "main", c.head_dim))
        if layer.has_indexer:
            compressed.append(self.indexer(b, layer, p, x, q_res, pos, seq))
        sink = self._w(b, f"{p}attn_sink", c.num_heads)
        attrs = {"layer": layer.index, "kind": "block" if draft else layer.attention, "ratio": layer.compress_ratio,
                 "window": c.sliding_window, "scale": c.head_dim ** -0.5}
        o = b.emit("sparse_attn", [q, kv, sink, pos, seq] + compressed, attrs, f"{tag}.attn")
        # The window rows are written after attention read the older ones: a chunk longer
        # than the window must not overwrite ring rows its own first queries still need. A
        # draft block's rows are scratch: the ring keeps the target-derived rows only.
        if not draft:
            b.emit("kv_write", [kv, pos, seq], {"layer": layer.index, "window": c.sliding_window}, f"{tag}.window")
        return self.attention_output(b, o, p, rope, pos, tag)

    def attention_output(self, b: Builder, o: Value, p: str, rope: dict, pos: Value, tag: str) -> Value:
        """The inverse rope of the attention output, then the grouped output projection."""
        c = self.cfg
        groups = self._local(c.o_groups)
        o = b.emit("rope", [o, pos], {**rope, "inverse": True}, f"{tag}.attn_derope")
        group_in = c.num_heads * c.head_dim // c.o_groups
        o = b.emit("reshape", [o], {"shape": ["T", groups, group_in]}, f"{tag}.attn_groups")
        wo_a = self._w(b, f"{p}wo_a.weight", c.o_groups * c.o_lora_rank, group_in)
        o = b.emit("grouped_linear", [o, wo_a], {"groups": groups, "quant": self.dense_quant}, f"{tag}.o_a")
        o = b.emit("reshape", [o], {"shape": ["T", groups * c.o_lora_rank]}, f"{tag}.o_a_flat")
        o = self._linear(b, o, f"{p}wo_b.weight", c.hidden_size, c.o_groups * c.o_lora_rank, self.dense_quant,
                         f"{tag}.attn_out")
        return self._reduce(b, o, f"{tag}.attn_out")

    def moe(self, b: Builder, layer: LayerSpec, prefix: str, x: Value, tokens: Value,
            images: Value | None = None) -> Value:
        """``images``: V4.1's ``image_index``, where image-span tokens select with ``gate.bias_vl``."""
        c, tag, p = self.cfg, f"l{layer.index}", f"{prefix}ffn."
        d, inter = c.hidden_size, c.moe_intermediate_size
        e, k = c.moe_experts(layer)
        gate = self._w(b, f"{p}gate.weight", e, d)
        if layer.moe == HASH_MOE:
            table = b.weight(f"{p}gate.tid2eid", i32(c.vocab_size, k))
            route = {"mode": "hash", "k": k, "scale": c.routed_scaling_factor}
        else:
            table = self._w(b, f"{p}gate.bias", e)
            route = {"mode": "topk", "k": k, "scale": c.routed_scaling_factor}
        if c.gate_temp != 1.0:
            route["temp"] = c.gate_temp
        ins = [x, gate, table, tokens] + ([] if images is None else [self._w(b, f"{p}gate.bias_vl", e), images])
        weights, ids = b.emit("moe_route", ins, route, [f"{tag}.route_w", f"{tag}.route_ids"])
        if self.tp > 1 and self.plan.expert_parallel:  # every rank routes every token; each runs its experts' pairs
            ids = b.emit("shard_ids", [ids, b.weight(EXPERT_FIRST, i32(1))], {"size": self._local(e)},
                         f"{tag}.local_ids")
        ex = [self._w(b, f"{p}experts.{w}", e, *shape) for w, shape in
              (("w1", (inter, d)), ("w2", (d, inter)), ("w3", (inter, d)))]
        routed = b.emit("experts", [x, weights, ids] + ex, {"limit": c.swiglu_limit, "quant": self.expert_quant},
                        f"{tag}.routed")
        sh = [self._w(b, f"{p}shared_experts.{w}.weight", *shape) for w, shape in
              (("w1", (inter, d)), ("w2", (d, inter)), ("w3", (inter, d)))]
        shared = b.emit("shared_expert", [x] + sh, {"limit": c.swiglu_limit, "quant": self.dense_quant},
                        f"{tag}.shared")
        return self._reduce(b, b.emit("add", [routed, shared], {}, f"{tag}.moe_out"), f"{tag}.moe_out")

    def head(self, b: Builder, h: Value, prefix: str) -> Value:
        return self.logits(b, self.head_hidden(b, h, prefix), prefix)

    def head_hidden(self, b: Builder, h: Value, prefix: str) -> Value:
        """The streams collapsed by the hc head, before the final norm."""
        c = self.cfg
        n, d = c.hc_mult, c.hidden_size
        fn = self._w(b, f"{prefix}hc_head_fn", n, n * d)
        base = self._w(b, f"{prefix}hc_head_base", n)
        scale = self._w(b, f"{prefix}hc_head_scale", 1)
        return b.emit("hc_head", [h, fn, base, scale], {"hc_mult": n, "hc_eps": c.hc_eps, "norm_eps": c.rms_norm_eps},
                      f"{prefix}y")

    def logits(self, b: Builder, y: Value, prefix: str) -> Value:
        c, d = self.cfg, self.cfg.hidden_size
        y = self._norm(b, y, f"{prefix}norm.weight", d, f"{prefix}y_normed")
        logits = b.emit("lm_head", [y, self._w(b, "head.weight", c.vocab_size, d)], {"quant": self.bf16_quant},
                        "logits")
        if self.tp == 1:
            return logits
        return b.emit("all_gather", [logits], {"size": c.vocab_size}, "logits.gathered")

    # ------------------------------------------------------------------ functions
    def step(self) -> Function:
        c = self.cfg
        if c.family == "v4.1":
            return self.v41_step()
        fn = Function("step")
        b = Builder(fn)
        tokens, pos, seq = b.input("tokens", i32("T")), b.input("positions", i32("T")), b.input("seq_ids", i32("T"))
        x = self._embed(b, tokens, "x")
        h = b.emit("hc_expand", [x], {"hc_mult": c.hc_mult}, "h0")
        drafter = self.traces_dspark
        taps = []
        for layer in c.layers:
            if drafter and layer.index in c.dspark.target_layers:  # the streams entering the layer
                taps.append(b.emit("hc_mean", [h], {}, f"dspark.tap{layer.index}"))
            h = self.block(b, layer, f"layers.{layer.index}.", h, tokens, pos, seq)
        if drafter:
            self.context_write(b, taps, pos, seq)
        fn.outputs = [self.head(b, h, ""), h]
        return fn

    def mtp(self, index: int) -> Function:
        """MTP layer (docs/v4.md, "Forward pass"): at position p, the backbone's last-layer streams of p and the
        token of p + 1 -> draft logits for p + 2, and the layer's own output streams (the next
        draft of a chain feeds them back as the streams of p + 1)."""
        c = self.cfg
        layer, prefix = c.mtp_layers[index], f"mtp.{index}."
        fn = Function(f"mtp{index}")
        b = Builder(fn)
        h = b.input("streams", f32("T", c.hc_mult, c.hidden_size))
        nxt = b.input("next_tokens", i32("T"))
        pos, seq = b.input("positions", i32("T")), b.input("seq_ids", i32("T"))
        d = c.hidden_size
        e = self._embed(b, nxt, "mtp.e")
        e = self._norm(b, e, f"{prefix}enorm.weight", d, "mtp.e_normed")
        e = self._linear(b, e, f"{prefix}e_proj.weight", d, d, self.dense_quant, "mtp.e_proj")
        e = b.emit("hc_expand", [e], {"hc_mult": c.hc_mult}, "mtp.e_streams")
        g = self._norm(b, h, f"{prefix}hnorm.weight", d, "mtp.h_normed")
        g = self._linear(b, g, f"{prefix}h_proj.weight", d, d, self.dense_quant, "mtp.h_proj")
        x = b.emit("add", [e, g], {}, "mtp.h0")
        x = self.block(b, layer, prefix, x, nxt, pos, seq)
        fn.outputs = [self.head(b, x, prefix), x]
        return fn


def trace(cfg: ModelConfig, numerics: str = "exact", mtp: bool = True, tensor_parallel: int = 1,
          expert_parallel: bool = True) -> Program:
    """The step program of ``cfg`` (plus one function per MTP layer, or the DSpark drafter's
    ``dspark_draft`` and ``dspark_markov``), verified; for
    ``tensor_parallel`` > 1 the program each rank runs (see the module docstring)."""
    from dsv4c.ir.verify import verify

    # bf16 numerics trace exact's graph (only the compiled matmuls differ, artifact.quant.NUMERICS).
    model = Model(cfg, traced_numerics(numerics), tensor_parallel, expert_parallel)
    functions = {"step": model.step()}
    if mtp and cfg.dspark is not None:
        if model.traces_dspark:
            functions.update({f.name: f for f in (model.dspark_draft(), model.dspark_markov())})
        else:
            print(f"dsv4c: warning: the DSpark drafter is not compiled for {tensor_parallel} ranks "
                  "(tensor parallelism runs without speculative decoding)", file=sys.stderr)
    elif mtp:
        for i in range(len(cfg.mtp_layers)):
            f = model.mtp(i)
            functions[f.name] = f
    program = Program(cfg, functions, model.numerics)
    verify(program)
    return program


__all__ = ["trace", "Model", "NUMERICS"]
