"""Dead-code elimination: nodes whose outputs nothing reads go, unless they write KV state."""

from __future__ import annotations

from dsv4c.ir.core import Program
from dsv4c.ir.ops import OPS


def eliminate_dead_code(program: Program) -> Program:
    for fn in program.functions.values():
        live = {id(v) for v in fn.outputs}
        kept = []
        for node in reversed(fn.nodes):
            if OPS[node.op].effect or any(id(o) in live for o in node.outputs):
                kept.append(node)
                live.update(id(v) for v in node.inputs)
        fn.nodes = kept[::-1]
        used = {v.name for n in fn.nodes for v in n.inputs if v.kind == "weight"}
        fn.weights = {k: v for k, v in fn.weights.items() if k in used}
    return program
