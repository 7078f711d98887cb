"""Norm + rope fusion: an rmsnorm whose only reader is a rope becomes one ``rmsnorm_rope``.

The query heads (unweighted per-head norm) and the window KV row (``kv_norm``) are both
normalised and then rotated; fused, the kernel reads and writes the tensor once instead of
twice."""

from __future__ import annotations

from dsv4c.ir.core import Function, Node, Program


def _fuse(fn: Function) -> None:
    readers: dict[int, list[Node]] = {}
    for node in fn.nodes:
        for v in node.inputs:
            readers.setdefault(id(v), []).append(node)
    returned = {id(v) for v in fn.outputs}
    replace: dict[int, Node | None] = {}
    for norm in fn.nodes:
        if norm.op != "rmsnorm" or id(norm.outputs[0]) in returned:
            continue
        users = readers.get(id(norm.outputs[0]), [])
        if len(users) != 1 or users[0].op != "rope" or users[0].attrs["inverse"] or users[0].inputs[0] is not norm.outputs[0]:
            continue
        rope = users[0]
        attrs = {"eps": norm.attrs["eps"], "rope": rope.attrs["rope"], "rope_dim": rope.attrs["rope_dim"]}
        fused = Node("rmsnorm_rope", norm.inputs + [rope.inputs[1]], attrs, rope.outputs)
        fused.outputs[0].producer = fused
        replace[id(rope)] = fused
        replace[id(norm)] = None
    fn.nodes = [replace.get(id(n), n) for n in fn.nodes if replace.get(id(n), n) is not None]


def fuse_norm_rope(program: Program) -> Program:
    for fn in program.functions.values():
        _fuse(fn)
    return program
