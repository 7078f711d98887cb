"""Projection merge: linears that read the same input with the same weight storage become
one GEMM over their weights concatenated along the output dimension (``linear_split``).

In V4 this merges ``wq_a`` + ``wkv`` (FP8), the compressor's and the indexer's ``wkv`` /
``wgate`` with ``weights_proj`` (BF16), and ``wq_b`` + ``indexer.wq_b``. FP8 weights are
only merged where the concatenation keeps every scale block (128x128, or V4.1's 32x32) inside
one weight, so the merged weight holds exactly the original codes and scales.
"""

from __future__ import annotations

from dsv4c.artifact.quant import WEIGHT_FORMATS, Fp8Blocks
from dsv4c.artifact.rows import ConcatRows, RowSource
from dsv4c.ir.core import Builder, Function, Node, Program, concat_name, concat_parts
from dsv4c.ir.ops import f32


def _block_aligned(nodes: list[Node], block: int) -> bool:
    return all(n.inputs[1].type.shape[0] % block == 0 for n in nodes[:-1])


def _merge(fn: Function) -> None:
    groups: dict[tuple[int, str], list[Node]] = {}
    for node in fn.nodes:
        if node.op == "linear" and node.inputs[1].kind == "weight":
            groups.setdefault((id(node.inputs[0]), node.attrs["quant"]), []).append(node)
    b = Builder(fn)
    replace: dict[int, Node | None] = {}
    for (_, quant), nodes in groups.items():
        fmt = WEIGHT_FORMATS.get(quant)
        if len(nodes) < 2 or (isinstance(fmt, Fp8Blocks) and not _block_aligned(nodes, fmt.group)):
            continue
        weights = [n.inputs[1] for n in nodes]
        sizes = [w.type.shape[0] for w in weights]
        merged_w = b.weight(concat_name([w.name for w in weights]), f32(sum(sizes), weights[0].type.shape[1]))
        node = Node("linear_split", [nodes[0].inputs[0], merged_w], {"quant": quant, "sizes": sizes},
                    [n.outputs[0] for n in nodes])
        for out in node.outputs:
            out.producer = node
        replace[id(nodes[0])] = node
        for n in nodes[1:]:
            replace[id(n)] = None
    if replace:
        fn.nodes = [replace.get(id(n), n) for n in fn.nodes if replace.get(id(n), n) is not None]
        used = {v.name for n in fn.nodes for v in n.inputs if v.kind == "weight"}
        fn.weights = {k: v for k, v in fn.weights.items() if k in used}


def merge_projections(program: Program) -> Program:
    for fn in program.functions.values():
        _merge(fn)
    return program


def base_weight_names(program: Program) -> set[str]:
    """The checkpoint weights a program reads, merged weights expanded into their parts."""
    names = set()
    for fn in program.functions.values():
        for name in fn.weights:
            names.update(concat_parts(name) or [name])
    return names


def weight_sources(program: Program, base: dict[str, RowSource]) -> dict[str, RowSource]:
    """Row sources by the program's names, from those of the checkpoint weights: a merged weight
    reads its parts' rows in turn, never copied whole."""
    out = {}
    for fn in program.functions.values():
        for name, value in fn.weights.items():
            parts = concat_parts(name)
            out[name] = base[name] if parts is None else ConcatRows([base[p] for p in parts], tuple(value.type.shape))
    return out


def materialize_weights(program: Program, base: dict) -> dict:
    """Weights by the program's names, in memory: merged weights concatenated (see weight_sources)."""
    import numpy as np

    out = {}
    for fn in program.functions.values():
        for name in fn.weights:
            parts = concat_parts(name)
            out[name] = base[name] if parts is None else np.concatenate([base[p] for p in parts], axis=0)
    return out
