"""DeepSeek-V4.1's ops on the compiled targets (docs/v41.md): ``mhc_mix`` and ``hc_collapse``
(the delayed mHC collapse), ``v41_roundtrip``, ``shared_compress`` (a KV source's compressor:
its group's compressed rows and index keys, stored once in the source's envelope rows that every
layer of the group reads), ``candidate_mask``, ``engram`` (the step input ``engram_rows``) and
``image_splice`` (the prefill function's inputs ``image_rows`` and ``image_index``)."""

from __future__ import annotations

from math import prod

import numpy as np
from tvm import relax, tirx

from dsv4c.artifact.engram_tables import table_format, table_inputs
from dsv4c.codegen.kernels.v41 import ROUNDTRIP_BLOCK
from dsv4c.codegen.ops.attention import main_planes, pool_envelope, store_kernel, store_pool_rows
from dsv4c.codegen.ops.base import (F32, I32, OpLowering, dense_compute, dense_quant, input_shapes, kernel,
                                    matmul_kernels)
from dsv4c.codegen.ops.norm import rope_call, rope_table


class MhcMix(OpLowering):
    def kernels(self, node, cfg, plan):
        a, h = node.attrs, input_shapes(node)[0]
        return {"main": kernel("mhc", h[1], h[2], a["sinkhorn_iters"], a["hc_eps"], a["norm_eps"], False, False,
                               False)}

    def emit(self, em, node, roles, args):
        weights = [em.param(v.name) for v in node.inputs[1:4]]
        outs = [(em.dims(o.type.shape), F32) for o in node.outputs]
        return em.outputs(em.call(roles["main"], args[:1] + weights, outs), len(outs))


class HcCollapse(OpLowering):
    def kernels(self, node, cfg, plan):
        h = input_shapes(node)[0]
        return {"main": kernel("hc_collapse", h[1], h[2], len(node.inputs) == 2)}

    def emit(self, em, node, roles, args):
        h = em.shape(args[0])
        pre = args[1] if len(args) == 2 else em.view(args[0], [h[0], h[1]])  # unread without pre
        return [em.call(roles["main"], [args[0], pre], ([h[0], h[2]], F32))]


class ImageSplice(OpLowering):
    """The image rows in place of the embeddings of image-span tokens: in the prefill function,
    which takes them; the decode function's steps have none (the runtime runs any step with an
    image position as a prefill)."""

    def kernels(self, node, cfg, plan):
        return {"main": kernel("image_splice", input_shapes(node)[0][1])}

    def emit(self, em, node, roles, args):
        if "image_index" not in em.inputs:
            return [args[0]]
        shape = em.shape(args[0])
        return [em.call(roles["main"], [args[0], em.inputs["image_index"], em.inputs["image_rows"]], (shape, F32))]


def roundtrip(em, spec, x):
    """``x`` (any shape, the round trip over its last axis) through a ``v41_roundtrip`` kernel."""
    shape = em.shape(x)
    flat = [prod(shape[:-1]), shape[-1]]
    return em.view(em.call(spec, [em.view(x, flat)], (flat, F32)), shape)


class V41Roundtrip(OpLowering):
    """A vector whose length is not a whole number of blocks passes unchanged (no kernel)."""

    def kernels(self, node, cfg, plan):
        width, fmt = input_shapes(node)[0][-1], node.attrs["format"]
        return {} if width % ROUNDTRIP_BLOCK[fmt] else {"main": kernel("v41_roundtrip", width, fmt)}

    def emit(self, em, node, roles, args):
        return [roundtrip(em, roles["main"], args[0]) if roles else args[0]]


class SharedCompress(OpLowering):
    """The windows a step closes pooled from the source's ring and the step's
    rows, normed, roped at the window's first position, round-tripped and stored as the group's
    compressed rows; their index keys projected from the same latents, normed, roped,
    round-tripped and stored in the group's index rows; then the ring takes the step's rows
    (kv, and the gate as the score ring; ratio 1: the kv in both, unread). The index-key weight
    ``indexer.wk`` (the last but one input) is a matmul weight in the plan's dense format."""

    weight_role = "key_gemv"

    def matmul_weights(self, node) -> list:
        return node.inputs[-2:-1] if node.attrs["index_keys"] else []

    def kernels(self, node, cfg, plan):
        a = node.attrs
        d, r, di = a["head_dim"], a["ratio"], a["index_dim"]
        out = {"reset": kernel("ring_reset", d, r), "windows": kernel("compress_windows", r, False),
               "pool": kernel("compress_pool", d, d, r, False, True), "norm": kernel("rmsnorm", d, a["eps"], True),
               "rope": kernel("rope", 1, d, a["rope_dim"], False), "store": store_kernel(cfg, plan, "main", d),
               "ring": kernel("ring_update", d, r, False)}
        if a["fake_quant"] and d % ROUNDTRIP_BLOCK["fp4_e4m3_b16"] == 0:
            out["quant"] = kernel("v41_roundtrip", d, "fp4_e4m3_b16")
        if a["index_keys"]:
            out.update(matmul_kernels("key_", di, d, dense_quant(node, plan), 0, dense_compute(node, plan)),
                       key_norm=kernel("rmsnorm", di, a["eps"], True),
                       key_rope=kernel("rope", 1, di, a["rope_dim"], False),
                       key_store=store_kernel(cfg, plan, "index", di))
            if a["fake_quant"] and di % ROUNDTRIP_BLOCK["fp4_b32"] == 0:
                out["key_quant"] = kernel("v41_roundtrip", di, "fp4_b32")
        return out

    def emit(self, em, node, roles, args):
        a, i = node.attrs, em.inputs
        r, d, layer = a["ratio"], a["head_dim"], a["layer"]
        kv = args[0]
        gate = args[4] if r > 1 else kv
        windows = em.r + tirx.floordiv(em.t, r)  # closes at most one more window than T / ratio
        win = em.call(roles["windows"], [i["requests"], i["block_table"], *pool_envelope(em, layer, False)],
                      [([windows, r], I32), ([windows], I32), ([windows], I32)])
        src, entry_pos, entry_rows = em.outputs(win, 3)
        ring = [f"state.{layer}.main.kv", f"state.{layer}.main.score"]
        em.pool[ring[0]], em.pool[ring[1]] = em.call_inplace(
            roles["reset"], [em.pool[ring[0]], em.pool[ring[1]], i["requests"]], [0, 1])
        # No ape in V4.1: zeros, so the score ring holds the gates.
        ape = relax.const(np.zeros((r, d), np.float32))
        latent = em.call(roles["pool"], [em.pool[ring[0]], em.pool[ring[1]], kv, gate, i["positions"], ape, src,
                                         entry_rows], ([windows, d], F32))
        latent = em.call(roles["norm"], [latent, em.param(node.inputs[1].name)], ([windows, d], F32))
        rows = rope_call(em, roles["rope"], latent, entry_pos, rope_table(em, "compress"))
        if "quant" in roles:
            rows = roundtrip(em, roles["quant"], rows)
        store_pool_rows(em, roles["store"], main_planes(em), entry_rows, rows)
        if a["index_keys"]:
            di = a["index_dim"]
            win = em.call(roles["windows"], [i["requests"], i["block_table"], *pool_envelope(em, layer, True)],
                          [([windows, r], I32), ([windows], I32), ([windows], I32)])
            key_rows = em.outputs(win, 3)[2]
            keys = em.matmul(roles, "key_", latent, em.weight(node.inputs[-2].name, roles["key_gemv"]), di)
            keys = em.call(roles["key_norm"], [keys, em.param(node.inputs[-1].name)], ([windows, di], F32))
            keys = rope_call(em, roles["key_rope"], keys, entry_pos, rope_table(em, "compress"))
            if "key_quant" in roles:
                keys = roundtrip(em, roles["key_quant"], keys)
            store_pool_rows(em, roles["key_store"], ["index"], key_rows, keys)
        em.pool[ring[0]], em.pool[ring[1]] = em.call_inplace(
            roles["ring"], [em.pool[ring[0]], em.pool[ring[1]], kv, gate, i["positions"], ape, i["requests"]], [0, 1])
        return [None]


class CandidateMask(OpLowering):
    """Each block's score (its best row; the newest visible row's block +inf), then the best
    blocks' rows (``kernels.v41.candidate_mask``)."""

    def kernels(self, node, cfg, plan):
        a = node.attrs
        return {"scores": kernel("candidate_block_scores", a["ratio"], a["block"]),
                "main": kernel("candidate_mask", a["block"], a["blocks"])}

    def emit(self, em, node, roles, args):
        n, e = em.shape(args[0])
        blocks = (e + node.attrs["block"] - 1) // node.attrs["block"]
        scores = em.call(roles["scores"], [args[0], em.inputs["positions"]], ([n, blocks], F32))
        return [em.call(roles["main"], [scores], ([n, e], F32))]


class Engram(OpLowering):
    """The token's table rows gathered by the step input ``engram_rows`` from its layer's table
    (the step inputs ``artifact.engram_tables.table_inputs`` name, not a weight), projected by
    ``wkv`` (a matmul weight in the plan's dense format) and gated into the streams."""

    weights, weight_role = slice(3, 4), "project_gemv"

    def kernels(self, node, cfg, plan):
        h, ids, table, wkv = input_shapes(node)[:4]
        return {"gather": kernel("engram_gather", table[1], ids[2], ids[1], node.attrs["slot"], table_format(cfg)),
                **matmul_kernels("project_", wkv[0], wkv[1], dense_quant(node, plan), 0, dense_compute(node, plan)),
                "gate": kernel("engram_gate", h[1], h[2], node.attrs["eps"])}

    def emit(self, em, node, roles, args):
        h = em.shape(args[0])
        qw, kw = (em.param(v.name) for v in node.inputs[4:6])
        table = [em.inputs[name] for name in table_inputs(em.cfg.engram.layer_ids[node.attrs["slot"]],
                                                          table_format(em.cfg))]
        wkv_shape = node.inputs[3].type.shape
        rows = em.call(roles["gather"], [em.inputs["engram_rows"], *table], ([h[0], wkv_shape[1]], F32))
        kv = em.matmul(roles, "project_", rows, em.weight(node.inputs[3].name, roles["project_gemv"]), wkv_shape[0])
        return [em.call(roles["gate"], [args[0], kv, qw, kw], (h, F32))]
