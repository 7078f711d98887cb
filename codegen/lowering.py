"""Which kernels each IR node calls on the CPU target, and how weights are laid out for them.

:func:`node_kernels` is the single place that names kernels: the builder instantiates and
compiles each distinct one once (kernels of the same shape are shared by all layers), the
manifest records, per node, the symbol of each role, and the runtime calls them by role.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from dsv4c.errors import UsageError
from dsv4c.frontend import lowbit
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
        return dense_kernel_quant(quant, plan.fp8_format)

    def _store(stream: str, width: int) -> KernelSpec:
        """Writes pool rows in the plan's format."""
        if stream == "index":
            return _k("store_rows", width, *index_format)
        if main_kv == "fp32":
            return _k("store_rows", width, "fp32")
        return _k("store_main_fp8", width - cfg.rope_dim, cfg.rope_dim, plan.fp8_format)

    ins = [v.type.shape if hasattr(v.type, "shape") else None for v in node.inputs]
    window, window_rows = cfg.sliding_window, cfg.num_layers * cfg.sliding_window
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
    if op in ("linear", "lm_head", "linear_split"):
        return _matmul("", *ins[1], _dense_quant(a["quant"]))
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
        return {"rows": _k("attention_rows", window, window_rows, a["ratio"], compressed),
                "main": _k("sparse_attn", ins[0][1], ins[0][2], a["scale"], *main_format)}
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
        q = _expert_quant(a["quant"])
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


def dense_kernel_quant(quant: str, fp8_format: str = "e4m3fn") -> str:
    """FP8 blocks stay FP8 (decoded in the kernel, fnuz on gfx942), BF16 stays BF16; the rest fp32."""
    if quant == "bf16":
        return "bf16"
    if quant != "fp8_b128":
        return "fp32"
    return "fp8fnuz_b128" if fp8_format == "e4m3fnuz" else "fp8_b128"


def _expert_quant(quant: str) -> str:
    return "fp4_g32" if quant == "fp4_g32" else "fp32"


# Shape-generic kernels every step calls (see step_kernels), by symbol.
GENERIC_KERNELS = ("gather_rows", "pad_rows", "slice_columns")


def kernel_factory(name: str):
    """The factory of a kernel named in a :class:`KernelSpec`."""
    from dsv4c.codegen import llvm_kernels, step_kernels

    return getattr(llvm_kernels, name, None) or getattr(step_kernels, name)


def kernel_table(program: Program, plan) -> tuple[dict[str, KernelSpec], list[dict[str, str]]]:
    """Distinct kernels of the step function, and per node the symbol of each role."""
    specs: dict[str, KernelSpec] = {name: KernelSpec(name, ()) for name in GENERIC_KERNELS}
    per_node = []
    for node in program.functions["step"].nodes:
        roles = node_kernels(node, program.config, plan)
        for spec in roles.values():
            specs[spec.symbol] = spec
        per_node.append({role: spec.symbol for role, spec in roles.items()})
    return specs, per_node


def weight_layout(program: Program, weights: dict[str, np.ndarray],
                  fp8_format: str = "e4m3fn") -> dict[str, tuple[str, np.ndarray]]:
    """Weights as the llvm kernels read them. Matmul weights are stored in column tiles
    ``[out / tile, in, tile]`` (see ``llvm_kernels.linear``); FP8 128x128 blocks as e4m3 codes
    with their scales expanded per column and tiled alike; FP4 experts packed two per byte +
    E8M0 scales per 32; tid2eid as int32; everything else fp32. Re-quantizing weights that
    came from the same format is lossless (power-of-two scales), so a checkpoint's FP8 / FP4
    values reach the kernels unchanged."""
    from dsv4c.codegen.llvm_kernels import column_tile

    matmul, fp8, fp4, bf16 = set(), set(), set(), set()
    for node in program.functions["step"].nodes:
        q = node.attrs.get("quant") or ""
        reads = {"linear": node.inputs[1:2], "linear_split": node.inputs[1:2], "lm_head": node.inputs[1:2],
                 "moe_route": node.inputs[1:2], "shared_expert": node.inputs[1:4], "grouped_linear": node.inputs[1:2],
                 "experts": node.inputs[3:6]}.get(node.op, [])
        matmul.update(v.name for v in reads)
        if node.op not in ("moe_route", "experts") and dense_kernel_quant(q) == "fp8_b128":
            fp8.update(v.name for v in reads)
        if node.op == "experts" and _expert_quant(q) == "fp4_g32":
            fp4.update(v.name for v in reads)
        if node.op in ("linear", "linear_split", "lm_head") and dense_kernel_quant(q) == "bf16":
            bf16.update(v.name for v in reads)
    groups = {n.inputs[1].name: n.attrs["groups"] for n in program.functions["step"].nodes if n.op == "grouped_linear"}

    def tiles(a: np.ndarray) -> np.ndarray:
        """[..., out, in] -> [..., out / tile, in, tile]; grouped weights tile each group's rows."""
        lead, (o, i) = a.shape[:-2], a.shape[-2:]
        t = column_tile(o)
        return np.ascontiguousarray(np.moveaxis(a.reshape(*lead, o // t, t, i), -2, -1))

    def grouped(name: str, a: np.ndarray) -> np.ndarray:
        g = groups.get(name, 1)
        return a.reshape(g, a.shape[0] // g, a.shape[1]) if g > 1 else a

    out: dict[str, tuple[str, np.ndarray]] = {}
    for name, value in weights.items():
        if value.dtype.kind in "iu":
            out[name] = ("I32", value.astype(np.int32))
        elif name in fp8:
            codes, scales = lowbit.quantize_fp8_blocks(value, 128, "e8m0")
            codes, scale = lowbit.fp8_in_format(codes, lowbit.decode_e8m0(scales), fp8_format)
            per_column = np.repeat(scale, 128, axis=0)[:value.shape[0]]
            out[name] = ("U8", tiles(grouped(name, codes)))
            out[name + ".scale"] = ("F32", tiles(grouped(name, per_column)))
        elif name in fp4:
            flat = value.reshape(-1, value.shape[-1])
            packed, scales = lowbit.quantize_fp4_groups(flat, 32)
            out[name] = ("U8", tiles(packed.view(np.uint8).reshape(*value.shape[:-1], -1)))
            out[name + ".scale"] = ("U8", tiles(scales.reshape(*value.shape[:-1], -1)))
        elif name in bf16:
            if not np.array_equal(lowbit.bf16_roundtrip(value), value):
                raise UsageError(f"weight {name} is declared BF16 but holds values BF16 cannot represent; "
                                 "fix the checkpoint's config (torch_dtype / quantization_config)")
            out[name] = ("BF16", tiles(lowbit.bf16_bits_from_f32(value)))
        elif name in matmul:
            out[name] = ("F32", tiles(grouped(name, np.asarray(value, np.float32))))
        else:
            out[name] = ("F32", np.ascontiguousarray(value, np.float32))
    return out
