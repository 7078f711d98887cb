"""mHC seam fusion: the post of one sub-layer and the pre of the next become one op.

In production kernels this is one launch per seam: the streams ``h'`` written by the post
are normalised, mixed and collapsed for the next sub-layer while still in registers. Layer
0's attention seam has no earlier post and stays an ``mhc_pre``; the last post folds into
``hc_head`` (``mhc_post_head``), which also returns the streams for the MTP layer.
"""

from __future__ import annotations

from dsv4c.ir.core import Function, Node, Program


def _fuse(fn: Function) -> None:
    consumer: dict[int, Node] = {}
    for node in fn.nodes:
        if node.op in ("mhc_pre", "hc_head"):
            consumer.setdefault(id(node.inputs[0]), node)
    fused: dict[int, Node] = {}  # id(post node) -> fused node; id(consumer) -> None (removed)
    removed: set[int] = set()
    for post in fn.nodes:
        if post.op != "mhc_post":
            continue
        nxt = consumer.get(id(post.outputs[0]))
        if nxt is None:
            continue
        streams = post.outputs[0]
        if nxt.op == "mhc_pre":
            node = Node("mhc_seam", post.inputs + nxt.inputs[1:], nxt.attrs, [streams] + nxt.outputs)
        else:
            node = Node("mhc_post_head", post.inputs + nxt.inputs[1:], nxt.attrs, [streams] + nxt.outputs)
        for out in node.outputs:
            out.producer = node
        fused[id(post)] = node
        removed.add(id(nxt))
    fn.nodes = [fused.get(id(n), n) for n in fn.nodes if id(n) not in removed]


def fuse_mhc_seams(program: Program) -> Program:
    for fn in program.functions.values():
        _fuse(fn)
    return program
