"""The DeepSeek-V4.1 step (docs/v41.md, "Forward pass"), traced by :class:`frontend.trace.Model`
through this mixin.

What differs from V4's block: an Engram layer gates its table rows into the streams first; each
mHC site's mixes come from its own input streams but its input is collapsed with the *previous*
site's ``pre`` (the model's first site takes stream 0, the head the last site's ``pre``, and
there is no hc head); queries get no per-head norm; a KV source's compressor writes its group's
rows and index keys (``shared_compress``); an index source scores the group's keys with its own
queries, a candidate source also keeps the best candidate blocks for the index sources after it,
and every other compressed layer attends the last top-k; window rows, compressed rows and index
queries and keys pass through V4.1's fake-quant round trips; the router divides by ``gate_temp``.

The step takes the Engram table rows of every token as an input (``engram_rows``, ``[T, L_e, C]``),
hashed on the host from each request's tokens (``artifact.engram``). A model that sees images
(``image_token_id``) also takes the rows of the image spans it feeds (``image_rows``, ``[I, D]``)
and which row each token takes (``image_index``, ``[T]``, -1 for text): those tokens' embeddings
are the rows, and their routers select experts with ``gate.bias_vl`` (docs/vision_text.md).
"""

from __future__ import annotations

from dsv4c.artifact.model_config import LayerSpec
from dsv4c.artifact.engram_tables import table_weight
from dsv4c.ir.core import Builder, Function, Value
from dsv4c.ir.ops import f32, i32


class V41Functions:
    """The V4.1 step; mixed into ``frontend.trace.Model``, whose helpers it uses."""

    def v41_step(self) -> Function:
        c = self.cfg
        fn = Function("step")
        b = Builder(fn)
        tokens, pos, seq = b.input("tokens", i32("T")), b.input("positions", i32("T")), b.input("seq_ids", i32("T"))
        rows = None
        if c.engram is not None:
            rows = b.input("engram_rows", i32("T", len(c.engram.layer_ids), c.engram.columns))
        x, images = self._embed(b, tokens, "x"), None
        if c.image_token_id is not None:
            images = b.input("image_index", i32("T"))
            x = b.emit("image_splice", [x, images, b.input("image_rows", f32("I", c.hidden_size))], {}, "x_images")
        h = b.emit("hc_expand", [x], {"hc_mult": c.hc_mult}, "h0")
        pre = None  # the first site takes stream 0
        published: dict = {"state": {}, "topk": {}, "candidates": None}
        for layer in c.layers:
            h, pre = self.v41_block(b, layer, h, pre, tokens, pos, seq, rows, published, images)
        y = b.emit("hc_collapse", [h, pre], {}, "y")
        fn.outputs = [self.logits(b, y, ""), h]
        return fn

    def _fake_quant(self, b: Builder, x: Value, fmt: str, hint: str) -> Value:
        """V4.1's round trip of ``x`` in format ``fmt``, where the model applies them (always, as
        released; a research config may turn them off)."""
        return b.emit("v41_roundtrip", [x], {"format": fmt}, hint) if self.cfg.activation_fake_quant else x

    def _mix(self, b: Builder, h: Value, prefix: str, which: str, tag: str):
        c = self.cfg
        n, d = c.hc_mult, c.hidden_size
        ws = [self._w(b, f"{prefix}hc_{which}_fn", c.hc_mix_size, n * d),
              self._w(b, f"{prefix}hc_{which}_base", c.hc_mix_size), self._w(b, f"{prefix}hc_{which}_scale", 3)]
        return b.emit("mhc_mix", [h] + ws, self._hc_attrs(),
                      [f"{tag}.{which}_pre", f"{tag}.{which}_post", f"{tag}.{which}_comb"])

    def v41_block(self, b: Builder, layer: LayerSpec, h: Value, pre: Value | None, tokens: Value, pos: Value,
                  seq: Value, rows: Value | None, published: dict, images: Value | None = None):
        """One layer: returns its output streams and the ``pre`` that collapses the next site's input."""
        c, tag, p = self.cfg, f"l{layer.index}", f"layers.{layer.index}."
        if layer.engram:
            e, d = c.engram, c.hidden_size
            ws = [self._w(b, table_weight(layer.index), e.num_embeddings[e.layer_ids.index(layer.index)], e.head_dim),
                  self._w(b, f"{p}engram.wkv.weight", (c.hc_mult + 1) * d, e.columns * e.head_dim),
                  self._w(b, f"{p}engram.q_weight", c.hc_mult, d), self._w(b, f"{p}engram.k_weight", c.hc_mult, d)]
            attrs = {"slot": e.layer_ids.index(layer.index), "eps": c.rms_norm_eps, "quant": self.dense_quant}
            h = b.emit("engram", [h, rows] + ws, attrs, f"{tag}.engram")
        attn_pre, post, comb = self._mix(b, h, p, "attn", tag)
        y = b.emit("hc_collapse", [h] if pre is None else [h, pre], {}, f"{tag}.attn_in")
        y = self._norm(b, y, f"{p}attn_norm.weight", c.hidden_size, f"{tag}.attn_x")
        out = self.v41_attention(b, layer, f"{p}attn.", y, pos, seq, published)
        h = b.emit("mhc_post", [out, h, post, comb], {}, f"{tag}.h_attn")
        ffn_pre, post, comb = self._mix(b, h, p, "ffn", tag)
        y = b.emit("hc_collapse", [h, attn_pre], {}, f"{tag}.ffn_in")
        y = self._norm(b, y, f"{p}ffn_norm.weight", c.hidden_size, f"{tag}.ffn_x")
        out = self.moe(b, layer, p, y, tokens, images)
        return b.emit("mhc_post", [out, h, post, comb], {}, f"{tag}.h"), ffn_pre

    def v41_attention(self, b: Builder, layer: LayerSpec, p: str, x: Value, pos: Value, seq: Value,
                      published: dict) -> Value:
        c, tag = self.cfg, f"l{layer.index}"
        rope = {"rope": "compress" if layer.is_compressed else "main", "rope_dim": c.rope_dim}
        q_res = self._linear(b, x, f"{p}wq_a.weight", c.q_lora_rank, c.hidden_size, self.dense_quant, f"{tag}.q_a")
        q_res = self._norm(b, q_res, f"{p}q_norm.weight", c.q_lora_rank, f"{tag}.q_res")
        q = self._linear(b, q_res, f"{p}wq_b.weight", c.num_heads * c.head_dim, c.q_lora_rank, self.dense_quant,
                         f"{tag}.q")
        q = b.emit("reshape", [q], {"shape": ["T", self._local(c.num_heads), c.head_dim]}, f"{tag}.q_heads")
        if c.q_head_norm:
            q = self._norm(b, q, None, c.head_dim, f"{tag}.q_normed")
        q = b.emit("rope", [q, pos], {**rope, "inverse": False}, f"{tag}.q_rope")
        kv = self._fake_quant(b, self.window_kv(b, x, p, rope, pos, tag), "fp8_b32", f"{tag}.kv_fp8")
        compressed = []
        if layer.is_kv_source:
            published["state"][layer.index] = self.v41_compressor(b, layer, p, x, pos, seq)
        if layer.is_compressed:
            state = published["state"][layer.kv_source]
            if layer.has_indexer:
                published["topk"][layer.index] = self.v41_indexer(b, layer, p, x, q_res, pos, seq, state, published)
            compressed = [state, published["topk"][layer.topk_source]]
        sink = self._w(b, f"{p}attn_sink", c.num_heads)
        attrs = {"layer": layer.index, "kind": "csa" if compressed else "sliding", "ratio": layer.compress_ratio,
                 "window": c.sliding_window, "scale": c.head_dim ** -0.5}
        o = b.emit("sparse_attn", [q, kv, sink, pos, seq] + compressed, attrs, f"{tag}.attn")
        b.emit("kv_write", [kv, pos, seq], {"layer": layer.index, "window": c.sliding_window}, f"{tag}.window")
        return self.attention_output(b, o, p, rope, pos, tag)

    def v41_compressor(self, b: Builder, layer: LayerSpec, p: str, x: Value, pos: Value, seq: Value) -> Value:
        """The KV source's compressor: the state token after its group's rows and keys are written."""
        c, tag = self.cfg, f"l{layer.index}.main"
        cp = f"{p}compressor."
        ins = [self._linear(b, x, f"{cp}wkv.weight", c.head_dim, c.hidden_size, self.bf16_quant, f"{tag}.ckv"),
               self._w(b, f"{cp}norm.weight", c.head_dim), pos, seq]
        if layer.compress_ratio > 1:
            ins.append(self._linear(b, x, f"{cp}wgate.weight", c.head_dim, c.hidden_size, self.bf16_quant,
                                    f"{tag}.cgate"))
        if layer.owns_index_keys:
            ins += [self._w(b, f"{p}indexer.wk.weight", c.index_head_dim, c.head_dim),
                    self._w(b, f"{p}indexer.k_norm.weight", c.index_head_dim)]
        attrs = {"layer": layer.index, "ratio": layer.compress_ratio, "head_dim": c.head_dim,
                 "index_dim": c.index_head_dim, "rope_dim": c.rope_dim, "eps": c.rms_norm_eps,
                 "index_keys": layer.owns_index_keys, "fake_quant": c.activation_fake_quant, "quant": self.dense_quant}
        return b.emit("shared_compress", ins, attrs, f"{tag}.entries")

    def v41_indexer(self, b: Builder, layer: LayerSpec, p: str, x: Value, q_res: Value, pos: Value, seq: Value,
                    state: Value, published: dict) -> Value:
        """An index source's top-k over its group's rows (inside the candidate blocks after the
        candidate source; the candidate source publishes them)."""
        c, tag = self.cfg, f"l{layer.index}.index"
        hi, di = c.index_n_heads, c.index_head_dim
        q = self._linear(b, q_res, f"{p}indexer.wq_b.weight", hi * di, c.q_lora_rank, self.dense_quant, f"{tag}.q")
        q = b.emit("reshape", [q], {"shape": ["T", hi, di]}, f"{tag}.q_heads")
        q = b.emit("rope", [q, pos], {"rope": "compress", "rope_dim": c.rope_dim, "inverse": False}, f"{tag}.q_rope")
        q = self._fake_quant(b, q, "fp4_b32", f"{tag}.q_fp4")
        weights = self._linear(b, x, f"{p}indexer.weights_proj.weight", hi, c.hidden_size, self.bf16_quant,
                               f"{tag}.w")
        scores = b.emit("index_score", [q, weights, pos, seq, state], {"layer": layer.index,
                                                                      "ratio": layer.compress_ratio},
                        f"{tag}.scores")
        level = layer.candidates
        if layer.is_candidate_source:
            published["candidates"] = b.emit("candidate_mask", [scores, pos, seq],
                                             {"ratio": layer.compress_ratio, "block": level.block_size,
                                              "blocks": level.blocks}, f"{tag}.candidates")
        elif level is not None:
            scores = b.emit("add", [scores, published["candidates"]], {}, f"{tag}.scores_in_candidates")
        return b.emit("index_topk", [scores], {"k": c.index_topk}, f"{tag}.topk")
