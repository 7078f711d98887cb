"""IR <-> JSON, so that an artifact carries the exact program its kernels were built for."""

from __future__ import annotations

from typing import Any

from dsv4c.errors import IRError
from dsv4c.ir.core import Function, Node, Program, Value
from dsv4c.ir.types import STATE, StateType, TensorType, Type


def _type_to_json(t: Type) -> Any:
    return "state" if isinstance(t, StateType) else {"dtype": t.dtype, "shape": list(t.shape)}


def _type_from_json(j: Any) -> Type:
    if j == "state":
        return STATE
    return TensorType(j["dtype"], tuple(j["shape"]))


def _attr(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def function_to_json(fn: Function) -> dict:
    return {
        "name": fn.name,
        "inputs": [{"name": v.name, "type": _type_to_json(v.type)} for v in fn.inputs],
        "weights": [{"name": v.name, "type": _type_to_json(v.type)} for v in fn.weights.values()],
        "nodes": [{"op": n.op, "inputs": [v.ref for v in n.inputs], "attrs": {k: _attr(a) for k, a in n.attrs.items()},
                   "outputs": [{"name": o.name, "type": _type_to_json(o.type)} for o in n.outputs]}
                  for n in fn.nodes],
        "outputs": [v.ref for v in fn.outputs],
    }


def function_from_json(j: dict) -> Function:
    fn = Function(j["name"])
    env: dict[str, Value] = {}
    for v in j["inputs"]:
        val = Value(v["name"], _type_from_json(v["type"]), "input")
        fn.inputs.append(val)
        env["%" + val.name] = val
    for v in j["weights"]:
        val = Value(v["name"], _type_from_json(v["type"]), "weight")
        fn.weights[val.name] = val
        env["@" + val.name] = val
    for n in j["nodes"]:
        try:
            node = Node(n["op"], [env[r] for r in n["inputs"]], n["attrs"], [])
        except KeyError as e:
            raise IRError(f"@{fn.name}: node {n['op']} uses undefined value {e.args[0]}") from None
        node.outputs = [Value(o["name"], _type_from_json(o["type"]), "node", node) for o in n["outputs"]]
        for o in node.outputs:
            env["%" + o.name] = o
        fn.nodes.append(node)
    fn.outputs = [env[r] for r in j["outputs"]]
    return fn


def program_to_json(p: Program) -> dict:
    return {"numerics": p.numerics, "functions": [function_to_json(f) for f in p.functions.values()]}


def program_from_json(j: dict, config) -> Program:
    from dsv4c.ir.verify import verify

    functions = {f["name"]: function_from_json(f) for f in j["functions"]}
    program = Program(config, functions, j["numerics"])
    verify(program)
    return program
