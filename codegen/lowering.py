"""Which kernels each IR node calls on the compiled targets, and how weights are laid out for them.

Each op's lowering (``codegen.ops``) names its kernels: :func:`node_kernels` asks it per node,
the builder instantiates and compiles each distinct kernel once (kernels of the same shape are
shared by all layers), the manifest records, per node, the symbol of each role, and the
runtime calls them by role.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dsv4c.artifact.engram_tables import FP8_TABLE, table_format
from dsv4c.artifact.pool import PoolGeometry
from dsv4c.artifact.quant import FP32, I32, I64, Fp8Blocks, QuantPlan, WeightFormat
from dsv4c.codegen.ops.base import KernelSpec
from dsv4c.artifact.rows import Rows
from dsv4c.ir.core import Node, Program
from dsv4c.ir.ops import COLLECTIVE_OPS
from dsv4c.targets import target_info


def node_kernels(node: Node, cfg, plan) -> dict[str, KernelSpec]:
    """The kernels of one node under a quantization plan (weight formats, pool row formats), by
    role: those its op's lowering names (``ops.registry``; it refuses ops it cannot compile)."""
    # Here rather than at the top: the lowerings import TVM, which the layouts do not need.
    from dsv4c.codegen.ops.registry import lowering_of

    return lowering_of(node.op).kernels(node, cfg, plan)


# Shape-generic kernels every step calls (see step_kernels), by symbol.
GENERIC_KERNELS = ("gather_rows", "pad_rows", "slice_columns")
# The copies around a decode step that replays CUDA graphs (relax_step: its int32 inputs in, its
# float32 outputs out, and FP8 Engram tables' uint8 codes in), by dtype.
GRAPH_COPY_KERNELS = {dtype: KernelSpec("copy_rows", (dtype,)) for dtype in ("int32", "float32", "uint8")}


def pool_row_kernels(dtype: str) -> dict[str, KernelSpec]:
    """The kernels that save (gather) and restore (scatter) rows of a pool tensor of ``dtype``
    (``relax_step.emit_pool_functions``); float32's gather is the step's own ``gather_rows``."""
    params = () if dtype == "float32" else (dtype,)
    return {"save": KernelSpec("gather_rows", params), "restore": KernelSpec("scatter_rows", params)}


def compiled_nodes(program: Program) -> list:
    """The nodes of every function the artifact compiles (``step``, then the MTP layers'), in
    order: they share one kernel table, one params tuple and one weight layout."""
    return [node for fn in program.functions.values() for node in fn.nodes]


def engram_table_names(program: Program) -> set[str]:
    """The program's Engram tables: weights of the IR, but not of the artifact's weight files:
    each lives in a file of its own that the runtime passes to the step (``artifact.engram_tables``)."""
    return {node.inputs[2].name for node in compiled_nodes(program) if node.op == "engram"}


def replays_cuda_graphs(program: Program, plan) -> bool:
    """Whether the step's decode functions replay captured CUDA graphs: on a target that has them,
    unless the step joins ranks (its collectives are callbacks into torch.distributed, which a
    captured graph would not call again: such steps launch their kernels one by one)."""
    return target_info(plan.target).cuda_graph and not any(n.op in COLLECTIVE_OPS for n in compiled_nodes(program))


def kernel_table(program: Program, plan) -> tuple[dict[str, KernelSpec], list[dict[str, str]]]:
    """Distinct kernels of the compiled functions (the pool functions' row kernels, and the graph
    copies where decode replays CUDA graphs, included), and per node (``compiled_nodes``) the
    symbol of each role."""
    specs: dict[str, KernelSpec] = {name: KernelSpec(name, ()) for name in GENERIC_KERNELS}
    if replays_cuda_graphs(program, plan):
        fp8_tables = program.config.engram is not None and table_format(program.config) == FP8_TABLE
        specs.update((spec.symbol, spec) for dtype, spec in GRAPH_COPY_KERNELS.items()
                     if dtype != "uint8" or fp8_tables)
    for dtype in sorted({t.dtype for t in PoolGeometry.build(program.config, plan).tensors()}):
        specs.update((spec.symbol, spec) for spec in pool_row_kernels(dtype).values())
    per_node = []
    for node in compiled_nodes(program):
        roles = node_kernels(node, program.config, plan)
        for spec in roles.values():
            specs[spec.symbol] = spec
        per_node.append({role: spec.symbol for role, spec in roles.items()})
    return specs, per_node


@dataclass(frozen=True)
class WeightLayout:
    """How the kernels read one IR weight: the artifact tensors it becomes and how any range of
    its rows turns into their bytes, so weights convert piece by piece.

    The weight is seen as a matrix ``[rows, cols]`` (cols = its last axis; stacked experts and
    the groups of a grouped weight one after another), stored in ``format`` (an
    ``artifact.quant.WeightFormat``). A ``tile`` > 0 stores matmul weights in column tiles
    ``[..., out / tile, cols, tile]`` (see the matmul kernels), per expert / per group; ``tile``
    0 stores the weight as is."""

    name: str
    shape: tuple[int, ...]
    format: WeightFormat
    tile: int = 0
    groups: int = 1

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1])

    def stored(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """The artifact tensors of this weight: name -> (dtype, shape)."""
        out = {}
        for suffix, (dtype, cols) in self.format.stored(self.shape[-1]).items():
            if not self.tile:
                out[self.name + suffix] = (dtype, (*self.shape[:-1], cols))
                continue
            lead, out_dim = (self.groups,) if self.groups > 1 else self.shape[:-2], self.shape[-2] // self.groups
            out[self.name + suffix] = (dtype, (*lead, out_dim // self.tile, cols, self.tile))
        return out

    def row_bytes(self) -> dict[str, int]:
        """Bytes each weight row takes in each artifact tensor (a range of rows starting at row
        r lies at byte r * row_bytes of the tensor, tiles included)."""
        return {self.name + suffix: n for suffix, n in self.format.row_bytes(self.shape[-1]).items()}

    @property
    def row_step(self) -> int:
        """Row ranges converted on their own start on multiples of this: whole tiles, and whole
        row blocks where FP8 block scales may have to be computed."""
        step = self.tile or 1
        return math.lcm(step, self.format.group) if isinstance(self.format, Fp8Blocks) else step

    def lay_out(self, parts: list[Rows]) -> dict[str, np.ndarray]:
        """The artifact bytes of a range of rows (starting on a multiple of ``row_step``), given
        as the checkpoint holds them: one :class:`Rows` per checkpoint tensor they come from."""
        arrays = self.format.lay_out(self.name, parts)
        return {self.name + suffix: column_tiles(a, self.tile) if self.tile else a for suffix, a in arrays.items()}


def column_tiles(rows: np.ndarray, tile: int) -> np.ndarray:
    """``[n, cols]`` -> ``[n / tile, cols, tile]``: each group of ``tile`` rows transposed.

    numpy copies 1- and 2-byte elements along a strided axis slowly, so the transpose runs
    on 8-byte words first (``g`` = 8 / itemsize columns each) and then only swaps the small
    ``[tile, g]`` blocks inside each word column (about twice as fast for FP8 / FP4 codes)."""
    n, cols = rows.shape
    rows = np.ascontiguousarray(rows)
    g = 8 // rows.itemsize
    if g == 1 or cols % g:
        return np.ascontiguousarray(rows.reshape(n // tile, tile, cols).transpose(0, 2, 1))
    words = np.ascontiguousarray(rows.view(np.uint64).reshape(n // tile, tile, cols // g).transpose(0, 2, 1))
    blocks = words.view(rows.dtype).reshape(n // tile, cols // g, tile, g)
    return np.ascontiguousarray(blocks.transpose(0, 1, 3, 2)).reshape(n // tile, cols, tile)


def weight_layouts(program: Program, plan: QuantPlan) -> dict[str, WeightLayout]:
    """The layout of every weight of every function, in program order, for ``plan``'s target.
    The reference target stores float32 / int64 as is; the others as the llvm kernels read them
    (the GPU targets share the layout): the weights the compiled functions multiply in column
    tiles, in the format the plan gives them (FP8 blocks as e4m3 codes with per-column scales,
    FP4 experts packed with E8M0 scales per 32, BF16 matmul weights as BF16 bits), tid2eid as
    int32, everything else float32. The Engram tables are not among them (``engram_table_names``)."""
    tables = engram_table_names(program)
    if plan.target == "reference":
        return {name: WeightLayout(name, tuple(v.type.shape), I64 if v.type.dtype.startswith("i") else FP32)
                for fn in program.functions.values() for name, v in fn.weights.items() if name not in tables}
    from dsv4c.codegen.kernels.formats import column_tile
    from dsv4c.codegen.ops.registry import lowering_of

    # A weight the compiled step multiplies takes the plan's format for it (its op says which
    # entry) and, when it stacks independent projections, is tiled per group; the rest is fp32.
    matmul: dict[str, WeightFormat] = {}
    groups: dict[str, int] = {}
    for node in compiled_nodes(program):
        lowering = lowering_of(node.op)
        for v in lowering.matmul_weights(node):
            matmul[v.name] = lowering.weight_format(node, plan)
            groups[v.name] = lowering.weight_groups(node)

    out: dict[str, WeightLayout] = {}
    for fn in program.functions.values():
        for name, value in fn.weights.items():
            if name in tables:
                continue
            shape, is_int = tuple(value.type.shape), value.type.dtype.startswith("i")
            g = groups.get(name, 1)
            tile = column_tile(shape[-2] // g) if name in matmul and not is_int else 0
            if is_int:
                out[name] = WeightLayout(name, shape, I32)
            else:
                out[name] = WeightLayout(name, shape, matmul.get(name, FP32), tile, g if tile else 1)
    return out
