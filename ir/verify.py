"""Structural and type verification, run after tracing and after every pass."""

from __future__ import annotations

from dsv4c.errors import IRError
from dsv4c.ir.core import Function, Program
from dsv4c.ir.ops import OPS, infer_types


def verify_function(fn: Function) -> None:
    defined: set[int] = set()
    names: set[str] = set()

    def define(v, where: str) -> None:
        if v.name in names and v.kind != "weight":
            raise IRError(f"@{fn.name}: value {v.ref} defined twice ({where})")
        names.add(v.name)
        defined.add(id(v))

    for v in fn.inputs:
        if v.kind != "input":
            raise IRError(f"@{fn.name}: parameter {v.ref} is not an input value")
        define(v, "input")
    for name, v in fn.weights.items():
        if v.kind != "weight" or v.name != name:
            raise IRError(f"@{fn.name}: weight table entry {name} is inconsistent")
        defined.add(id(v))
    for i, node in enumerate(fn.nodes):
        where = f"node {i} ({node.op})"
        if node.op not in OPS:
            raise IRError(f"@{fn.name}: {where}: unknown op")
        for v in node.inputs:
            if id(v) not in defined:
                raise IRError(f"@{fn.name}: {where} uses {v.ref} before it is defined")
            if v.kind == "weight" and fn.weights.get(v.name) is not v:
                raise IRError(f"@{fn.name}: {where} uses weight {v.ref} missing from the weight table")
        try:
            expected = infer_types(node.op, [v.type for v in node.inputs], node.attrs)
        except IRError as e:
            raise IRError(f"@{fn.name}: {where}: {e}") from None
        got = [o.type for o in node.outputs]
        if expected != got:
            raise IRError(f"@{fn.name}: {where}: outputs typed {got}, inputs imply {expected}")
        for o in node.outputs:
            if o.producer is not node or o.kind != "node":
                raise IRError(f"@{fn.name}: {where}: output {o.ref} does not point back to its node")
            define(o, where)
    for v in fn.outputs:
        if id(v) not in defined:
            raise IRError(f"@{fn.name}: returns undefined value {v.ref}")


def verify(program: Program) -> None:
    if not program.functions:
        raise IRError("program has no functions")
    if program.numerics not in ("exact", "qat"):
        raise IRError(f"numerics {program.numerics!r} is not exact/qat")
    for fn in program.functions.values():
        verify_function(fn)
