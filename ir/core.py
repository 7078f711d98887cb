"""The dsv4c IR: typed SSA values, nodes, functions and programs.

Small on purpose, in the spirit of ``torch.fx``: a :class:`Function` is an ordered list of
:class:`Node` s over :class:`Value` s; weights are named parameters (``@layers.0.attn.wq_a``)
that the runtime binds, never constants. Ops with side effects on the KV state
(``kv_write``, ``compress``) return a ``state`` token, so the reads that depend on them
(``index_score``, ``sparse_attn``) name that dependency explicitly.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Iterable

from dsv4c.ir.ops import infer_types
from dsv4c.ir.types import TensorType, Type


CONCAT = "concat"


def concat_name(parts: list[str]) -> str:
    """The name of a weight made of others concatenated along the output dimension (a pass
    merges projections so)."""
    return f"{CONCAT}({','.join(parts)})"


def concat_parts(name: str) -> list[str] | None:
    """The weights a merged weight is made of, or None for a checkpoint weight."""
    if name.startswith(CONCAT + "(") and name.endswith(")"):
        return name[len(CONCAT) + 1:-1].split(",")
    return None


class Value:
    """An SSA value: a function input, a weight, or a node output."""

    __slots__ = ("name", "type", "kind", "producer")

    def __init__(self, name: str, type: Type, kind: str, producer: "Node | None" = None):
        self.name, self.type, self.kind, self.producer = name, type, kind, producer

    @property
    def ref(self) -> str:
        return ("@" if self.kind == "weight" else "%") + self.name

    def __repr__(self) -> str:
        return f"{self.ref}: {self.type}"


class Node:
    __slots__ = ("op", "inputs", "attrs", "outputs")

    def __init__(self, op: str, inputs: Iterable[Value], attrs: dict[str, Any], outputs: Iterable[Value]):
        self.op = op
        self.inputs = list(inputs)
        self.attrs = dict(attrs)
        self.outputs = list(outputs)

    def __repr__(self) -> str:
        return format_node(self)


@dataclass
class Function:
    name: str
    inputs: list[Value] = field(default_factory=list)
    weights: dict[str, Value] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)
    outputs: list[Value] = field(default_factory=list)

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.op] = counts.get(n.op, 0) + 1
        return counts


@dataclass
class Program:
    """Everything the compiler hands from stage to stage: functions plus the model description."""

    config: Any  # dsv4c.artifact.model_config.ModelConfig
    functions: dict[str, Function]
    numerics: str = "exact"  # "exact" (fp32, what transformers computes) or "qat" (official QAT round trips)

    def __str__(self) -> str:
        return format_program(self)


class Builder:
    """Appends nodes to a function with fresh, readable value names."""

    def __init__(self, fn: Function):
        self.fn = fn
        self._taken: set[str] = {v.name for v in fn.inputs}
        self._counter = itertools.count()

    def _fresh(self, hint: str) -> str:
        name = hint
        while name in self._taken:
            name = f"{hint}.{next(self._counter)}"
        self._taken.add(name)
        return name

    def input(self, name: str, type: Type) -> Value:
        v = Value(self._fresh(name), type, "input")
        self.fn.inputs.append(v)
        return v

    def weight(self, name: str, type: TensorType) -> Value:
        if name in self.fn.weights:
            if self.fn.weights[name].type != type:
                raise ValueError(f"weight @{name} used with two types")
            return self.fn.weights[name]
        v = Value(name, type, "weight")
        self.fn.weights[name] = v
        return v

    def emit(self, op: str, inputs: list[Value], attrs: dict[str, Any] | None = None,
             names: str | list[str] | None = None) -> Value | tuple[Value, ...]:
        attrs = dict(attrs or {})
        out_types = infer_types(op, [v.type for v in inputs], attrs)
        hints = [names] if isinstance(names, str) else list(names or [])
        hints += [op] * (len(out_types) - len(hints))
        node = Node(op, inputs, attrs, [])
        node.outputs = [Value(self._fresh(h), t, "node", node) for h, t in zip(hints, out_types)]
        self.fn.nodes.append(node)
        return node.outputs[0] if len(node.outputs) == 1 else tuple(node.outputs)


# --------------------------------------------------------------------------- printing


def _format_attr(v: Any) -> str:
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_format_attr(x) for x in v) + "]"
    if isinstance(v, str):
        return v if v.replace("_", "").replace(".", "").isalnum() else repr(v)
    return str(v)


def format_node(n: Node) -> str:
    outs = ", ".join(o.ref for o in n.outputs)
    args = ", ".join(v.ref for v in n.inputs)
    attrs = ""
    if n.attrs:
        attrs = " {" + ", ".join(f"{k}={_format_attr(v)}" for k, v in sorted(n.attrs.items())) + "}"
    types = ", ".join(str(o.type) for o in n.outputs)
    return f"{outs} = {n.op}({args}){attrs} : {types}"


def format_function(fn: Function) -> str:
    params = ", ".join(f"{v.ref}: {v.type}" for v in fn.inputs)
    results = ", ".join(f"{v.ref}: {v.type}" for v in fn.outputs)
    lines = [f"func @{fn.name}({params}) -> ({results}) {{"]
    lines += [f"  {format_node(n)}" for n in fn.nodes]
    lines.append(f"  return {', '.join(v.ref for v in fn.outputs)}")
    lines.append("}")
    return "\n".join(lines)


def format_program(p: Program) -> str:
    header = f"// dsv4c IR: model={p.config.name} layers={p.config.num_layers} numerics={p.numerics}"
    return "\n\n".join([header] + [format_function(f) for f in p.functions.values()]) + "\n"
