"""Which kernels each IR node calls on the CPU target, and how weights are laid out for them.

:func:`node_kernels` is the single place that names kernels: the builder instantiates and
compiles each distinct one once (kernels of the same shape are shared by all layers), the
manifest records, per node, the symbol of each role, and the runtime calls them by role.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from dsv4c.artifact.quant import BF16, FP8_BLOCK, FP32, I32, I64, Fp8Blocks, WeightFormat, dense_format, expert_format
from dsv4c.errors import UsageError
from dsv4c.frontend.checkpoint import Rows
from dsv4c.ir.core import Node, Program


@dataclass(frozen=True)
class KernelSpec:
    factory: str  # function name in dsv4c.codegen.llvm_kernels or movement_kernels
    params: tuple

    @property
    def symbol(self) -> str:
        raw = "_".join([self.factory] + [str(p) for p in self.params])
        return re.sub(r"[^A-Za-z0-9_]", "p", raw)


def _k(factory: str, *params) -> KernelSpec:
    return KernelSpec(factory, tuple(params))


UNSUPPORTED = {"fp8_roundtrip", "fp4_roundtrip", "hadamard"}


def node_kernels(node: Node, cfg, plan) -> dict[str, KernelSpec]:
    """The kernels of one node under a quantization plan (weight formats, pool row formats), by
    role; ``relax_step`` calls them. Bookkeeping kernels (``step_kernels``) turn the step's
    per-request tables into pool rows on the device."""
    a, op = node.attrs, node.op
    main_kv, index_kv = plan.main_kv.storage, plan.index_kv.storage
    # The pool rows' byte format, the same for the store kernels that write them and the kernels
    # that read them: storage, and for low-bit rows the FP8 encoding and the index layout.
    index_format = (index_kv,) if index_kv == "fp32" else (index_kv, plan.fp8_format, plan.index_kv.layout)
    main_format = (main_kv,) if main_kv == "fp32" else (main_kv, cfg.rope_dim, plan.fp8_format)

    def _dense_quant(quant: str) -> str:
        return dense_format(quant, plan.fp8_format).name

    def _store(stream: str, width: int) -> KernelSpec:
        """Writes pool rows in the plan's format."""
        if stream == "index":
            return _k("store_rows", width, *index_format)
        if main_kv == "fp32":
            return _k("store_rows", width, "fp32")
        return _k("store_main_fp8", width - cfg.rope_dim, cfg.rope_dim, plan.fp8_format)

    ins = [v.type.shape if hasattr(v.type, "shape") else None for v in node.inputs]
    window, window_rows = cfg.sliding_window, cfg.window_rows_per_request
    if op in UNSUPPORTED:
        raise UsageError(f"the llvm target does not compile op {op!r} yet (qat numerics / fused passes); "
                         "use --target reference or --numerics exact")
    if op == "embed":
        return {"main": _k("embed", *ins[1])}
    if op == "hc_expand":
        return {"main": _k("hc_expand", a["hc_mult"], ins[0][1])}
    if op in ("mhc_pre", "hc_head", "mhc_seam", "mhc_post_head"):
        h = ins[0] if op in ("mhc_pre", "hc_head") else ins[1]
        iters = a.get("sinkhorn_iters", 0)
        return {"main": _k("mhc", h[1], h[2], iters, a["hc_eps"], a["norm_eps"], op in ("mhc_seam", "mhc_post_head"),
                           op in ("hc_head", "mhc_post_head"))}
    if op == "mhc_post":
        return {"main": _k("mhc_post", ins[1][1], ins[1][2])}
    if op == "rmsnorm":
        return {"main": _k("rmsnorm", ins[0][-1], a["eps"], len(ins) == 2)}
    if op in ("linear", "linear_split"):
        return _matmul("", *ins[1], _dense_quant(a["quant"]))
    if op == "lm_head":
        # Every step takes the logits of a few rows (one per request), prefill steps too: the
        # GEMV streams the head once per GEMV_ROWS rows, where the GEMM would decode it into
        # panels for a block of 8 rows, 7 of them padding (see relax_step.op_lm_head).
        return {"gemv": _k("linear", *ins[1], _dense_quant(a["quant"]), True, 0)}
    if op == "reshape":
        return {}
    if op == "add":
        return {"main": _k("add", int(np.prod(ins[0][1:])))}
    if op == "rope":
        shape = ins[0]
        heads = shape[1] if len(shape) == 3 else 1
        return {"main": _k("rope", heads, shape[-1], a["rope_dim"], a["inverse"])}
    if op == "rmsnorm_rope":
        shape = ins[0]
        heads = shape[1] if len(shape) == 3 else 1
        return {"main": _k("rmsnorm_rope", heads, shape[-1], a["rope_dim"], a["eps"], len(ins) == 3)}
    if op == "kv_write":
        return {"rows": _k("window_rows", window, window_rows), "store": _store("main", ins[0][1])}
    if op == "compress":
        width, d, r = ins[0][1], a["head_dim"], a["ratio"]
        return {"reset": _k("ring_reset", width, 2 * r if a["overlap"] else r),
                "windows": _k("compress_windows", r, a["overlap"]),
                "pool": _k("compress_pool", width, d, r, a["overlap"]),
                "norm": _k("rmsnorm", d, a["eps"], True), "rope": _k("rope", 1, d, a["rope_dim"], False),
                "store": _store(a["stream"], d), "ring": _k("ring_update", width, r, a["overlap"])}
    if op == "index_score":
        return {"rows": _k("entry_rows", a["ratio"]), "main": _k("index_score", ins[0][1], ins[0][2], *index_format)}
    if op == "index_topk":
        return {"main": _k("topk_rows", a["k"])}
    if op == "sparse_attn":
        compressed = {"sliding": "none", "hca": "all", "csa": "topk"}[a["kind"]]
        from dsv4c.codegen.kernels.attention import ATTN_PREFILL_HEAD_BLOCK

        # Prefill takes wider blocks of heads on the CPU (GPU builds run one head per thread
        # either way, the same code under two symbols).
        return {"rows": _k("attention_rows", window, window_rows, a["ratio"], compressed),
                "main": _k("sparse_attn", ins[0][1], ins[0][2], a["scale"], *main_format),
                "prefill": _k("sparse_attn", ins[0][1], ins[0][2], a["scale"], main_kv, *(main_format[1:] or (0, None)),
                              ATTN_PREFILL_HEAD_BLOCK)}
    if op == "grouped_linear":
        # The groups are independent projections of the heads: one kernel runs them all.
        g, rows_in = a["groups"], ins[1]
        return _matmul("", rows_in[0] // g, rows_in[1], _dense_quant(a["quant"]), g if g > 1 else 0)
    if op == "moe_route":
        e, d = ins[1]
        out = {**_matmul("gate_", e, d, "fp32"), "scores": _k("route_scores", e),
               "weights": _k("route_weights", e, a["k"], a["scale"])}
        if a["mode"] == "hash":
            out["select"] = _k("hash_ids", ins[2][0], a["k"])
        else:
            out.update(bias=_k("add_bias", e), select=_k("topk_rows", a["k"]))
        return out
    if op == "experts":
        # Routed (token, slot) pairs grouped by expert on the device, then each expert's matmuls
        # over its group, then every token's experts added in ascending id order.
        e, inter, d = ins[3]
        q = expert_format(a["quant"]).name
        k = ins[2][1]
        return {"group": _k("moe_group", k, e), "up": _k("expert_linear", inter, d, q, e),
                "act": _k("swiglu", inter, a["limit"]), "down": _k("expert_linear", d, inter, q, e),
                "combine": _k("moe_combine", d, k)}
    if op == "shared_expert":
        inter, d = ins[1]
        q = _dense_quant(a["quant"])
        return {**_matmul("up_", inter, d, q), "act": _k("swiglu", inter, a["limit"]), **_matmul("down_", d, inter, q)}
    raise UsageError(f"no llvm lowering for op {op!r}")


def _matmul(prefix: str, out_dim: int, in_dim: int, quant: str, groups: int = 0) -> dict[str, KernelSpec]:
    """A weight's two matmul kernels: GEMV for decode-sized steps, GEMM (8-row blocks) for prefill."""
    return {f"{prefix}gemv": _k("linear", out_dim, in_dim, quant, True, groups),
            f"{prefix}gemm": _k("linear", out_dim, in_dim, quant, False, groups)}


# Shape-generic kernels every step calls (see step_kernels), by symbol.
GENERIC_KERNELS = ("gather_rows", "pad_rows", "slice_columns")


def kernel_factory(name: str):
    """The factory of a kernel named in a :class:`KernelSpec`."""
    from dsv4c.codegen import step_kernels
    from dsv4c.codegen.kernels import KERNELS

    return KERNELS.get(name) or getattr(step_kernels, name)


def compiled_nodes(program: Program) -> list:
    """The nodes of every function the artifact compiles (``step``, then the MTP layers'), in
    order: they share one kernel table, one params tuple and one weight layout."""
    return [node for fn in program.functions.values() for node in fn.nodes]


def kernel_table(program: Program, plan) -> tuple[dict[str, KernelSpec], list[dict[str, str]]]:
    """Distinct kernels of the compiled functions, and per node (``compiled_nodes``) the symbol
    of each role."""
    specs: dict[str, KernelSpec] = {name: KernelSpec(name, ()) for name in GENERIC_KERNELS}
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
        128-row blocks where FP8 scales may have to be computed."""
        step = self.tile or 1
        return math.lcm(step, FP8_BLOCK) if isinstance(self.format, Fp8Blocks) else step

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


def weight_layouts(program: Program, target: str, fp8_format: str = "e4m3fn") -> dict[str, WeightLayout]:
    """The layout of every weight of every function, in program order. The reference target
    stores float32 / int64 as is; the others as the llvm kernels read them (the GPU targets
    share the layout): the weights the compiled functions multiply in column tiles, FP8 128x128
    blocks as e4m3 codes with per-column scales, FP4 experts packed with E8M0 scales per 32,
    BF16 matmul weights as BF16 bits, tid2eid as int32, everything else float32."""
    if target == "reference":
        return {name: WeightLayout(name, tuple(v.type.shape), I64 if v.type.dtype.startswith("i") else FP32)
                for fn in program.functions.values() for name, v in fn.weights.items()}
    from dsv4c.codegen.kernels.formats import column_tile

    # A weight the compiled step multiplies keeps its low-bit format; everything else is fp32.
    matmul: dict[str, WeightFormat] = {}
    for node in compiled_nodes(program):
        q = node.attrs.get("quant") or ""
        reads = {"linear": node.inputs[1:2], "linear_split": node.inputs[1:2], "lm_head": node.inputs[1:2],
                 "moe_route": node.inputs[1:2], "shared_expert": node.inputs[1:4], "grouped_linear": node.inputs[1:2],
                 "experts": node.inputs[3:6]}.get(node.op, [])
        if node.op == "experts":
            fmt = expert_format(q)
        elif node.op == "moe_route":
            fmt = FP32
        else:
            fmt = dense_format(q, fp8_format)
            if fmt is BF16 and node.op not in ("linear", "linear_split", "lm_head"):
                fmt = FP32  # the shared expert and the grouped projection read BF16 checkpoints as fp32
        matmul.update((v.name, fmt) for v in reads)
    groups = {n.inputs[1].name: n.attrs["groups"] for n in compiled_nodes(program) if n.op == "grouped_linear"}

    out: dict[str, WeightLayout] = {}
    for fn in program.functions.values():
        for name, value in fn.weights.items():
            shape, is_int = tuple(value.type.shape), value.type.dtype.startswith("i")
            g = groups.get(name, 1)
            tile = column_tile(shape[-2] // g) if name in matmul and not is_int else 0
            if is_int:
                out[name] = WeightLayout(name, shape, I32)
            else:
                out[name] = WeightLayout(name, shape, matmul.get(name, FP32), tile, g if tile else 1)
    return out
