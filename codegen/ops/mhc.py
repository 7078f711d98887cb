"""The hyper-connection (mHC) ops: the streams' expansion, the fused pre / seam / head mixes,
the post mix, and the plain mean over the streams (``hc_mean``, the DSpark drafter's taps)."""

from __future__ import annotations

from dsv4c.codegen.ops.base import F32, OpLowering, input_shapes, kernel


class HcExpand(OpLowering):
    def kernels(self, node, cfg, plan):
        return {"main": kernel("hc_expand", node.attrs["hc_mult"], input_shapes(node)[0][1])}

    def emit(self, em, node, roles, args):
        return [em.call(roles["main"], [args[0]], (em.dims(node.outputs[0].type.shape), F32))]


class HcMean(OpLowering):
    def kernels(self, node, cfg, plan):
        h = input_shapes(node)[0]
        return {"main": kernel("hc_mean", h[1], h[2])}

    def emit(self, em, node, roles, args):
        return [em.call(roles["main"], [args[0]], (em.dims(node.outputs[0].type.shape), F32))]


class Mhc(OpLowering):
    """One ``mhc`` kernel: ``mhc_pre`` / ``hc_head`` read the streams and three weights; the
    seams (``mhc_seam``, ``mhc_post_head``) fuse the previous sub-layer's ``mhc_post`` in front,
    so its four inputs (the streams second) come before the weights. ``head``: the mix into the
    head (``hc_head``, ``mhc_post_head``), which has no Sinkhorn iterations."""

    def __init__(self, seam: bool, head: bool):
        self.seam, self.head = seam, head
        self.streams = 1 if seam else 0  # the input holding the streams
        self.first_weight = 4 if seam else 1

    def kernels(self, node, cfg, plan):
        a, h = node.attrs, input_shapes(node)[self.streams]
        return {"main": kernel("mhc", h[1], h[2], a.get("sinkhorn_iters", 0), a["hc_eps"], a["norm_eps"], self.seam,
                               self.head)}

    def emit(self, em, node, roles, args):
        weights = [em.param(v.name) for v in node.inputs[self.first_weight:self.first_weight + 3]]
        outs = [(em.dims(o.type.shape), F32) for o in node.outputs]
        res = em.call(roles["main"], args[:self.first_weight] + weights, outs)
        return em.outputs(res, len(outs)) if len(outs) > 1 else [res]


class MhcPost(OpLowering):
    def kernels(self, node, cfg, plan):
        h = input_shapes(node)[1]
        return {"main": kernel("mhc_post", h[1], h[2])}

    def emit(self, em, node, roles, args):
        return [em.call(roles["main"], args[:4], (em.dims(node.outputs[0].type.shape), F32))]
