"""The DSpark block drafter's part of the trace (docs/v4.md, "DSpark").

Mixed into ``frontend.trace.Model`` (whose helpers it calls): the context write the target
``step`` does for every fed position, and the drafter's two functions.

* ``step``, after its layers: the mean streams entering each of ``dspark.target_layers``,
  side by side, through ``mtp.0.main_proj`` / ``main_norm`` give ``main_x``; each stage ``s``
  writes ``rope(kv_norm(wkv_s @ main_x))`` into its window ring (layer ``n + s``), so the
  drafter never runs the target twice.
* ``dspark_draft``: a block of rows per request (the anchor, then noise tokens, at consecutive
  positions) through the stages, each attending its ring before the block and the whole block
  (``sparse_attn`` of kind ``block``, nothing written); returns the base logits and the head
  hidden rows ``y`` (before the final norm).
* ``dspark_markov``: for rows of ``y`` and each row's previous token, the Markov bias
  ``markov_w2 @ markov_w1[prev]`` and the confidence logit ``proj @ [y ; markov_w1[prev]]``
  (without a confidence head: the Markov embedding in its place).
"""

from __future__ import annotations

from dsv4c.ir.core import Builder, Function, Value
from dsv4c.ir.ops import f32, i32


class DsparkFunctions:
    """The drafter's trace; the host class provides the cfg, the weights and the blocks."""

    def context_write(self, b: Builder, taps: list[Value], pos: Value, seq: Value) -> None:
        c = self.cfg
        d = c.hidden_size
        x = taps[0] if len(taps) == 1 else b.emit("concat", taps, {}, "dspark.taps")
        x = self._linear(b, x, "mtp.0.main_proj.weight", d, len(taps) * d, self.dense_quant, "dspark.main_proj")
        x = self._norm(b, x, "mtp.0.main_norm.weight", d, "dspark.main_x")
        rope = {"rope": "main", "rope_dim": c.rope_dim}
        for s, layer in enumerate(c.mtp_layers):
            kv = self.window_kv(b, x, f"mtp.{s}.attn.", rope, pos, f"dspark.{s}")
            b.emit("kv_write", [kv, pos, seq], {"layer": layer.index, "window": c.sliding_window},
                   f"dspark.{s}.window")

    def dspark_draft(self) -> Function:
        c = self.cfg
        fn = Function("dspark_draft")
        b = Builder(fn)
        tokens, pos, seq = b.input("tokens", i32("T")), b.input("positions", i32("T")), b.input("seq_ids", i32("T"))
        h = b.emit("hc_expand", [self._embed(b, tokens, "x")], {"hc_mult": c.hc_mult}, "h0")
        for s, layer in enumerate(c.mtp_layers):
            h = self.block(b, layer, f"mtp.{s}.", h, tokens, pos, seq, draft=True)
        last = f"mtp.{len(c.mtp_layers) - 1}."
        y = self.head_hidden(b, h, last)
        fn.outputs = [self.logits(b, y, last), y]
        return fn

    def dspark_markov(self) -> Function:
        c, ds = self.cfg, self.cfg.dspark
        d, r = c.hidden_size, ds.markov_rank
        last = f"mtp.{len(c.mtp_layers) - 1}."
        fn = Function("dspark_markov")
        b = Builder(fn)
        prev = b.input("tokens", i32("T"))
        b.input("positions", i32("T"))  # the calling convention of every function; the math needs no position
        b.input("seq_ids", i32("T"))
        y = b.input("streams", f32("T", d))
        e = b.emit("embed", [prev, self._w(b, f"{last}markov_head.markov_w1.weight", c.vocab_size, r)], {},
                   "markov.e")
        bias = b.emit("lm_head", [e, self._w(b, f"{last}markov_head.markov_w2.weight", c.vocab_size, r)],
                      {"quant": self.bf16_quant}, "markov.bias")
        if not ds.confidence_head:
            fn.outputs = [bias, e]
            return fn
        ye = b.emit("concat", [y, e], {}, "confidence.in")
        conf = self._linear(b, ye, f"{last}confidence_head.proj.weight", 1, d + r, self.bf16_quant, "confidence")
        fn.outputs = [bias, conf]
        return fn
