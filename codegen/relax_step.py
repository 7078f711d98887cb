"""The compiled step: the post-pass IR ``step`` function lowered to Relax functions that call
the TIR kernels, so one VM call runs a whole step on the artifact's device.

Each entry function takes the step's compact inputs (:data:`STEP_INPUTS`: the tokens, their
positions and requests, per request its pool slot, span and block table, the rows whose logits
to return, and the widest compressed-entry visibility per compress ratio), the weights and
constants as one tuple (``params``, names in :attr:`StepModule.params`) and the KV pool's
tensors as one tuple (``pool``, :attr:`StepModule.pool`), which the function updates in place
(``call_tir_inplace``). It returns the logits of the requested rows. All row bookkeeping is done
by ``step_kernels`` on the device: the host uploads O(tokens + requests) integers and reads
back only the logits.

Two entry functions share the body and differ in their matmul kernels and memory bounds:
``decode`` (at most :data:`GEMV_MAX_ROWS` tokens: GEMV kernels that stream each weight once)
and ``prefill`` (up to ``max_step_tokens``: GEMM kernels over 8-row blocks). Bindings are
emitted in program order outside dataflow blocks, so every read of a pool tensor happens
before the in-place write that follows it in the program.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax, tirx

from dsv4c.artifact.pool import PoolTensor
from dsv4c.codegen.kernels.formats import FP8_DECODERS
from dsv4c.codegen.kernels.matmul import GEMM_ROWS
from dsv4c.codegen.lowering import KernelSpec, compiled_nodes, node_kernels
from dsv4c.errors import UnsupportedModelError
from dsv4c.ir.core import Program

GEMV_MAX_ROWS = 4  # steps with at most this many tokens run the decode function
I32, F32 = "int32", "float32"
# The step's inputs, in the entry functions' argument order (before params and pool).
STEP_INPUTS = ("tokens", "positions", "token_request", "requests", "block_table", "logit_rows", "entry_extents")
# An MTP function's inputs after those: the streams it starts from (a step's, or its own output
# when drafts chain) and which of their rows each token takes. Its ``tokens`` are the tokens
# of the next positions (SPEC "MTP").
MTP_INPUTS = ("streams", "stream_rows")


def entry_functions(program: Program, max_step_tokens: int) -> dict[str, tuple[str, bool, int]]:
    """Entry function -> (the IR function it runs, GEMV kernels?, its token bound): ``decode`` and
    ``prefill`` run ``step``; an MTP layer ``mtp0`` gets ``mtp0_decode`` and ``mtp0_prefill``."""
    out = {}
    for source in program.functions:
        for suffix, gemv, bound in (("decode", True, GEMV_MAX_ROWS), ("prefill", False, max_step_tokens)):
            out[suffix if source == "step" else f"{source}_{suffix}"] = (source, gemv, bound)
    return out


@dataclass
class StepModule:
    module: tvm.IRModule
    functions: list[str]
    params: list[str]  # the params tuple: stored weight names and constants
    pool: list[PoolTensor]
    entry_ratios: list[int]  # compress ratios of entry_extents, in order
    max_step_tokens: int


def _scaled(quant: str) -> bool:
    return quant in FP8_DECODERS or quant == "fp4_g32"


class _Emitter:
    """Emits one entry function: IR nodes in order, each as its kernel calls."""

    def __init__(self, bb: relax.BlockBuilder, program: Program, geometry, gvars: dict, per_node: dict[str, list],
                 params: list[tuple[str, tuple, str]], gemv: bool, cuda_graph: bool):
        self.bb, self.program, self.cfg, self.geometry = bb, program, program.config, geometry
        self.gvars, self.per_node, self.gemv, self.cuda_graph = gvars, per_node, gemv, cuda_graph
        self.param_index = {name: i for i, (name, _, _) in enumerate(params)}
        self.param_types = [(shape, dtype) for _, shape, dtype in params]
        self._params: dict[str, relax.Var] = {}

    # ------------------------------------------------------------------ helpers
    def call(self, kernel: KernelSpec | str, args: list, out) -> relax.Var:
        """call_tir of a kernel (a spec, or a generic kernel's name); ``out`` is one (shape,
        dtype) or a list of them."""
        outs = [relax.TensorType(list(s), d) for s, d in (out if isinstance(out, list) else [out])]
        return self.bb.emit(relax.call_tir(self._gvar(kernel), args, outs if isinstance(out, list) else outs[0]))

    def _gvar(self, kernel: KernelSpec | str):
        return self.gvars[kernel if isinstance(kernel, str) else kernel.symbol]

    def call_inplace(self, kernel: KernelSpec, args: list, written: list[int]) -> list[relax.Var]:
        """call_tir_inplace writing ``args[i]`` for i in ``written``: the new versions of those."""
        types = [args[i].ty for i in written]
        out = self.bb.emit(relax.call_tir_inplace(self._gvar(kernel), args, written,
                                                  types if len(types) > 1 else types[0]))
        if len(written) == 1:
            return [out]
        return [self.bb.emit(relax.TupleGetItem(out, i)) for i in range(len(written))]

    def outputs(self, var: relax.Var, n: int) -> list[relax.Var]:
        return [self.bb.emit(relax.TupleGetItem(var, i)) for i in range(n)]

    def view(self, x: relax.Var, shape) -> relax.Var:
        return self.bb.emit(relax.op.memory.view(x, relax.ShapeExpr(list(shape))))

    def param(self, name: str) -> relax.Var:
        if name not in self._params:
            self._params[name] = self.bb.emit(relax.TupleGetItem(self.params_var, self.param_index[name]))
        return self._params[name]

    def weight(self, name: str, kernel: KernelSpec) -> list[relax.Var]:
        """A matmul weight and, when its kernel reads scales, the scales."""
        return [self.param(name)] + ([self.param(name + ".scale")] if _scaled(_weight_quant(kernel)) else [])

    @staticmethod
    def shape(x: relax.Var) -> list:
        return [int(v) if isinstance(v, tirx.IntImm) else v for v in x.ty.shape.values]

    def dims(self, ir_shape) -> list:
        return [self.sym.get(d, d) if isinstance(d, str) else d for d in ir_shape]

    # ------------------------------------------------------------------ matmuls
    def matmul(self, roles: dict, prefix: str, x: relax.Var, weight: list, out_dim: int,
               gemv: bool | None = None) -> relax.Var:
        """y = x @ W.T over rows x [n, (G,) in]: GEMV in the decode function (or where ``gemv``
        says so); in prefill the rows are zero-padded to whole blocks of GEMM_ROWS (and G groups
        laid out one after another) for the GEMM kernel and the result is a prefix view."""
        shape = self.shape(x)
        lead = shape[1:-1]
        if self.gemv if gemv is None else gemv:
            return self.call(roles[prefix + "gemv"], [x] + weight, (shape[:-1] + [out_dim], F32))
        n, groups, width = shape[0], int(_prod(lead)), shape[-1]
        blocks = tirx.floordiv(n + GEMM_ROWS - 1, GEMM_ROWS)
        padded = self.call("pad_rows", [self.view(x, [n, groups, width])], ([groups, blocks * GEMM_ROWS, width], F32))
        y = self.call(roles[prefix + "gemm"], [self.view(padded, lead + [blocks, GEMM_ROWS, width])] + weight,
                      ([blocks, GEMM_ROWS] + lead + [out_dim], F32))
        return self.view(y, [n] + lead + [out_dim])

    # ------------------------------------------------------------------ function
    def function(self, name: str, source: str, max_tokens: int) -> None:
        """Emit entry function ``name`` running IR function ``source``; it returns (the logits
        of the requested rows, the last streams: the backbone's last layer for ``step``, the
        MTP layer's own for an MTP function)."""
        cfg, bb = self.cfg, self.bb
        t, r, b, lr, s = (tirx.Var(v, "int64") for v in ("T", "R", "B", "L", "S"))
        self.ratios = sorted({layer.compress_ratio for layer in cfg.layers if layer.is_compressed})
        extents = [tirx.Var(f"E{ratio}", "int64") for ratio in self.ratios]
        self.entries = dict(zip(self.ratios, extents))
        pool_rows, index_rows, slots = (tirx.Var(v, "int64") for v in ("pool_rows", "index_rows", "slots"))
        self.pool_rows, self.t, self.r = pool_rows, t, r
        self.sym = {"T": t}
        inputs = {
            "tokens": relax.Var("tokens", relax.TensorType([t], I32)),
            "positions": relax.Var("positions", relax.TensorType([t], I32)),
            "token_request": relax.Var("token_request", relax.TensorType([t], I32)),
            "requests": relax.Var("requests", relax.TensorType([r, 4], I32)),
            "block_table": relax.Var("block_table", relax.TensorType([r, b], I32)),
            "logit_rows": relax.Var("logit_rows", relax.TensorType([lr], I32)),
            "entry_extents": relax.Var("entry_extents", relax.ShapeType(extents)),
        }
        fn = self.program.functions[source]
        if source != "step":
            inputs["streams"] = relax.Var("streams", relax.TensorType([s, cfg.hc_mult, cfg.hidden_size], F32))
            inputs["stream_rows"] = relax.Var("stream_rows", relax.TensorType([t], I32))
        self.inputs = inputs
        self.params_var = relax.Var("params", relax.TupleType(
            [relax.TensorType(list(shape), dtype) for shape, dtype in self.param_types]))
        rows_of = {"main": pool_rows, "index": index_rows}
        self.pool_layout = self.geometry.tensors()
        pool_var = relax.Var("pool", relax.TupleType(
            [relax.TensorType([rows_of[p.rows]] + list(p.shape) if p.rows != "slots" else [slots] + list(p.shape),
                              p.dtype) for p in self.pool_layout]))
        bounds = {"T": max_tokens, "R": max_tokens, "L": max_tokens, "S": max(max_tokens, GEMV_MAX_ROWS)}
        attrs = {"tir_var_upper_bound": bounds, "relax.force_pure": True}
        if self.gemv and self.cuda_graph:
            # Decode steps replay one CUDA graph per (tokens, requests, logit rows); regions that
            # depend on the context length (entry and block counts) launch between the graphs.
            attrs["relax.rewrite_cuda_graph.capture_symbolic_vars"] = ["T", "R", "L"]
        with bb.function(name, list(inputs.values()) + [self.params_var, pool_var], attrs=attrs):
            self.pool = {}
            for i, p in enumerate(self.pool_layout):
                v = bb.emit(relax.TupleGetItem(pool_var, i))
                if p.rows == "slots":  # rings as rows: slot s owns rows [s * ring rows, (s + 1) * ring rows)
                    v = self.view(v, [slots * p.shape[0], p.shape[1]])
                self.pool[p.name] = v
            env: dict[int, relax.Var] = {}
            if source == "step":
                for v, key in zip(fn.inputs, ("tokens", "positions")):
                    env[id(v)] = inputs[key]
            else:  # streams, next tokens, positions (seq_ids: the kernels read token_request)
                width = cfg.hc_mult * cfg.hidden_size
                rows = self.call("gather_rows", [self.view(inputs["streams"], [s, width]), inputs["stream_rows"]],
                                 ([t, width], F32))
                env[id(fn.inputs[0])] = self.view(rows, [t, cfg.hc_mult, cfg.hidden_size])
                env[id(fn.inputs[1])], env[id(fn.inputs[2])] = inputs["tokens"], inputs["positions"]
            logits = None
            for node, roles in zip(fn.nodes, self.per_node[source]):
                args = [env.get(id(v)) for v in node.inputs]
                outs = getattr(self, "op_" + node.op)(node, roles, args)
                for o, val in zip(node.outputs, outs):
                    env[id(o)] = val
                if node.op == "lm_head":
                    logits = outs[0]
            bb.emit_func_output(relax.Tuple([logits, env[id(fn.outputs[1])]]))

    # ------------------------------------------------------------------ ops
    def op_embed(self, node, roles, args):
        return [self.call(roles["main"], [self.inputs["tokens"], self.param(node.inputs[1].name)],
                          ([self.t, node.inputs[1].type.shape[1]], F32))]

    def op_hc_expand(self, node, roles, args):
        return [self.call(roles["main"], [args[0]], (self.dims(node.outputs[0].type.shape), F32))]

    def _hc(self, node, roles, args, first_weight: int):
        weights = [self.param(v.name) for v in node.inputs[first_weight:first_weight + 3]]
        outs = [(self.dims(o.type.shape), F32) for o in node.outputs]
        res = self.call(roles["main"], args[:first_weight] + weights, outs)
        return self.outputs(res, len(outs)) if len(outs) > 1 else [res]

    def op_mhc_pre(self, node, roles, args):
        return self._hc(node, roles, args, 1)

    op_hc_head = op_mhc_pre

    def op_mhc_seam(self, node, roles, args):
        return self._hc(node, roles, args, 4)

    op_mhc_post_head = op_mhc_seam

    def op_mhc_post(self, node, roles, args):
        return [self.call(roles["main"], args[:4], (self.dims(node.outputs[0].type.shape), F32))]

    def _ones(self, dim: int) -> relax.Var:
        return self.param(f"const.ones.{dim}")

    def op_rmsnorm(self, node, roles, args):
        x = args[0]
        shape = self.shape(x)
        flat = [_prod(shape[:-1]), shape[-1]]
        w = self.param(node.inputs[1].name) if len(node.inputs) == 2 else self._ones(shape[-1])
        return [self.view(self.call(roles["main"], [self.view(x, flat), w], (flat, F32)), shape)]

    def op_linear(self, node, roles, args):
        x, w = args[0], node.inputs[1]
        shape = self.shape(x)
        out_dim = w.type.shape[0]
        y = self.matmul(roles, "", self.view(x, [_prod(shape[:-1]), shape[-1]]), self.weight(w.name, roles["gemv"]),
                        out_dim)
        return [self.view(y, shape[:-1] + [out_dim])]

    def op_lm_head(self, node, roles, args):
        """The logits of the rows ``logit_rows`` names, by GEMV in every function (see lowering)."""
        rows = self.inputs["logit_rows"]
        x = self.call("gather_rows", [args[0], rows], ([self.shape(rows)[0], self.shape(args[0])[1]], F32))
        w = node.inputs[1]
        return [self.matmul(roles, "", x, self.weight(w.name, roles["gemv"]), w.type.shape[0], gemv=True)]

    def op_linear_split(self, node, roles, args):
        (y,) = self.op_linear(node, roles, args)
        n = self.shape(y)[0]
        flat = self.view(y, [n, _prod(self.shape(y)[1:])])
        outs, start = [], 0
        for size, o in zip(node.attrs["sizes"], node.outputs):
            part = self.call("slice_columns", [flat, relax.prim_value(tirx.IntImm("int64", start))], ([n, size], F32))
            outs.append(self.view(part, self.dims(o.type.shape)))
            start += size
        return outs

    def op_reshape(self, node, roles, args):
        return [self.view(args[0], self.dims(node.attrs["shape"]))]

    def op_add(self, node, roles, args):
        shape = self.shape(args[0])
        flat = [shape[0], _prod(shape[1:])]
        out = self.call(roles["main"], [self.view(args[0], flat), self.view(args[1], flat)], (flat, F32))
        return [self.view(out, shape)]

    def _rope_call(self, symbol, x, *rest):
        shape = self.shape(x)
        heads = [shape[0], shape[1] if len(shape) == 3 else 1, shape[-1]]
        return self.view(self.call(symbol, [self.view(x, heads), *rest], (heads, F32)), shape)

    def op_rope(self, node, roles, args):
        return [self._rope_call(roles["main"], args[0], args[1], self.param(f"const.rope.{node.attrs['rope']}"))]

    def op_rmsnorm_rope(self, node, roles, args):
        x = args[0]
        w = self.param(node.inputs[1].name) if len(node.inputs) == 3 else self._ones(self.shape(x)[-1])
        return [self._rope_call(roles["main"], x, w, args[-1], self.param(f"const.rope.{node.attrs['rope']}"))]

    def op_grouped_linear(self, node, roles, args):
        x, w = args[0], node.inputs[1]
        n, groups, width = self.shape(x)
        rank = w.type.shape[0] // groups
        x = self.view(x, [n, width]) if groups == 1 else x  # one group: a plain projection
        y = self.matmul(roles, "", x, self.weight(w.name, roles["gemv"]), rank)
        return [self.view(y, [n, groups, rank])]

    def op_moe_route(self, node, roles, args):
        y = args[0]
        t = self.shape(y)[0]
        k, e = node.attrs["k"], node.inputs[1].type.shape[0]
        logits = self.matmul(roles, "gate_", y, self.weight(node.inputs[1].name, roles["gate_gemv"]), e)
        scores = self.call(roles["scores"], [logits], ([t, e], F32))
        if node.attrs["mode"] == "hash":
            ids = self.call(roles["select"], [self.param(node.inputs[2].name), self.inputs["tokens"]], ([t, k], I32))
        else:
            biased = self.call(roles["bias"], [scores, self.param(node.inputs[2].name)], ([t, e], F32))
            ids = self.call(roles["select"], [biased], ([t, k], I32))
        weights = self.call(roles["weights"], [scores, ids], ([t, k], F32))
        return [weights, ids]

    def op_experts(self, node, roles, args):
        y, route_w, ids = args[:3]
        t, d = self.shape(y)
        k = self.shape(ids)[1]
        e, inter, _ = node.inputs[3].type.shape
        pairs = t * k
        grouped = self.call(roles["group"], [ids], [([e + 1], I32), ([pairs], I32), ([t, k], I32)])
        offsets, pair_token, token_pair = self.outputs(grouped, 3)
        xs = self.call("gather_rows", [y, pair_token], ([pairs, d], F32))
        w1, w2, w3 = (self.weight(v.name, roles["up"]) for v in node.inputs[3:6])
        gate = self.call(roles["up"], [xs, offsets] + w1, ([pairs, inter], F32))
        up = self.call(roles["up"], [xs, offsets] + w3, ([pairs, inter], F32))
        act = self.call(roles["act"], [gate, up], ([pairs, inter], F32))
        down = self.call(roles["down"], [act, offsets] + w2, ([pairs, d], F32))
        return [self.call(roles["combine"], [down, token_pair, route_w], ([t, d], F32))]

    def op_shared_expert(self, node, roles, args):
        y = args[0]
        t = self.shape(y)[0]
        w1, w2, w3 = node.inputs[1:4]
        inter = w1.type.shape[0]
        gate = self.matmul(roles, "up_", y, self.weight(w1.name, roles["up_gemv"]), inter)
        up = self.matmul(roles, "up_", y, self.weight(w3.name, roles["up_gemv"]), inter)
        act = self.call(roles["act"], [gate, up], ([t, inter], F32))
        return [self.matmul(roles, "down_", act, self.weight(w2.name, roles["down_gemv"]), w2.type.shape[0])]

    # ------------------------------------------------------------------ KV state
    def _i64(self, value: int):
        return relax.prim_value(tirx.IntImm("int64", int(value)))

    def _main_planes(self) -> list[str]:
        return [p.name for p in self.pool_layout if p.rows == "main"]

    def _store(self, symbol: str, planes: list[str], rows, values) -> None:
        new = self.call_inplace(symbol, [self.pool[p] for p in planes] + [rows, values], list(range(len(planes))))
        for p, v in zip(planes, new):
            self.pool[p] = v

    def op_kv_write(self, node, roles, args):
        i = self.inputs
        rows = self.call(roles["rows"], [i["positions"], i["token_request"], i["requests"],
                                         self._i64(node.attrs["layer"]), relax.prim_value(self.pool_rows)],
                         ([self.t], I32))
        self._store(roles["store"], self._main_planes(), rows, args[0])
        return [None]

    def _envelope(self, layer: int, index: bool) -> tuple:
        """(rows per envelope, offset of this layer's rows) of the main or the index pool."""
        g = self.geometry
        rows = g.rows_of(layer)
        if index:
            return self._i64(g.index_rows_per_envelope), self._i64(rows.index_offset)
        return self._i64(g.rows_per_envelope), self._i64(rows.offset)

    def op_compress(self, node, roles, args):
        a, i = node.attrs, self.inputs
        ratio, d, stream = a["ratio"], a["head_dim"], a["stream"]
        kv, gate = args[0], args[1]
        slots = 2 * ratio if a["overlap"] else ratio
        windows = self.r + tirx.floordiv(self.t, ratio)  # closes at most one more window than T / ratio
        win = self.call(roles["windows"], [i["requests"], i["block_table"], *self._envelope(a["layer"], stream == "index")],
                        [([windows, slots], I32), ([windows], I32), ([windows], I32)])
        src, entry_pos, entry_rows = self.outputs(win, 3)
        ring = [f"state.{a['layer']}.{stream}.kv", f"state.{a['layer']}.{stream}.score"]
        self.pool[ring[0]], self.pool[ring[1]] = self.call_inplace(
            roles["reset"], [self.pool[ring[0]], self.pool[ring[1]], i["requests"]], [0, 1])
        ape = self.param(node.inputs[2].name)
        pooled = self.call(roles["pool"], [self.pool[ring[0]], self.pool[ring[1]], kv, gate, i["positions"], ape, src,
                                           entry_rows], ([windows, d], F32))
        normed = self.call(roles["norm"], [pooled, self.param(node.inputs[3].name)], ([windows, d], F32))
        roped = self._rope_call(roles["rope"], normed, entry_pos, self.param("const.rope.compress"))
        self._store(roles["store"], ["index"] if stream == "index" else self._main_planes(), entry_rows, roped)
        # The ring changes after pooling read it (bindings run in program order).
        new = self.call_inplace(roles["ring"], [self.pool[ring[0]], self.pool[ring[1]], kv, gate, i["positions"], ape,
                                                i["requests"]], [0, 1])
        self.pool[ring[0]], self.pool[ring[1]] = new
        return [None]

    def op_index_score(self, node, roles, args):
        i, ratio = self.inputs, node.attrs["ratio"]
        extent = self.entries[ratio]
        rows = self.call(roles["rows"], [i["positions"], i["token_request"], i["block_table"],
                                         *self._envelope(node.attrs["layer"], True)], ([self.t, extent], I32))
        return [self.call(roles["main"], [args[0], args[1], self.pool["index"], rows], ([self.t, extent], F32))]

    def op_index_topk(self, node, roles, args):
        return [self.call(roles["main"], [args[0]], ([self.t, node.attrs["k"]], I32))]

    def op_sparse_attn(self, node, roles, args):
        a, i = node.attrs, self.inputs
        window = self.cfg.sliding_window
        common = [i["positions"], i["token_request"], i["requests"]]
        layer = [self._i64(a["layer"]), relax.prim_value(self.pool_rows)]
        if a["kind"] == "sliding":
            rows = self.call(roles["rows"], common + layer, ([self.t, window], I32))
        elif a["kind"] == "hca":
            rows = self.call(roles["rows"], common + [i["block_table"]] + layer + [*self._envelope(a["layer"], False)],
                             ([self.t, window + self.entries[a["ratio"]]], I32))
        else:
            topk = args[6]
            rows = self.call(roles["rows"], common + [i["block_table"], topk] + layer +
                             [*self._envelope(a["layer"], False)], ([self.t, window + self.shape(topk)[1]], I32))
        planes = [self.pool[p] for p in self._main_planes()]
        attend = roles["main" if self.gemv else "prefill"]  # prefill: wider blocks of heads
        out = self.call(attend, [args[0]] + planes + [args[1], self.param(node.inputs[2].name), rows],
                        (self.shape(args[0]), F32))
        return [out]


def _prod(dims):
    out = 1
    for d in dims:
        out = out * d
    return out


def _weight_quant(kernel: KernelSpec) -> str:
    """The weight format a matmul kernel (``linear`` or ``expert_linear``) reads."""
    return kernel.params[2]


MATMUL_WEIGHTS = {"linear": slice(1, 2), "linear_split": slice(1, 2), "lm_head": slice(1, 2),
                  "grouped_linear": slice(1, 2), "moe_route": slice(1, 2), "shared_expert": slice(1, 4),
                  "experts": slice(3, 6)}  # the node inputs its matmul kernels read


def _matmul_kernel(roles: dict) -> KernelSpec | None:
    """The kernel that reads a node's matmul weights (its gate for MoE routing), if any."""
    for role in ("gemv", "up_gemv", "up", "gate_gemv"):
        if role in roles:
            return roles[role]
    return None


def step_params(program: Program, per_node: list[dict]) -> list[tuple[str, tuple, str]]:
    """(name, shape, dtype) of each tensor in the params tuple: every stored weight the step
    reads (a matmul weight as its kernel reads it, ``llvm_kernels.weight_storage``: its codes or
    values, then ``<name>.scale``), then the constants (``constant_names``)."""
    from dsv4c.codegen.kernels.formats import weight_storage

    out: dict[str, tuple[tuple, str]] = {}
    for node, roles in zip(compiled_nodes(program), per_node):
        matmul = node.inputs[MATMUL_WEIGHTS[node.op]] if node.op in MATMUL_WEIGHTS else []
        for v in node.inputs:
            if v.kind != "weight" or v.name in out:
                continue
            shape = tuple(v.type.shape)
            if any(v is m for m in matmul):
                kernel = _matmul_kernel(roles)
                groups = node.attrs.get("groups", 1) if node.op == "grouped_linear" else 1
                lead = (groups,) if groups > 1 else shape[:-2]
                parts = weight_storage(shape[-2] // groups, shape[-1], _weight_quant(kernel))
                for suffix, (part_shape, dtype) in zip(("", ".scale"), parts):
                    out[v.name + suffix] = (lead + part_shape, dtype)
            else:
                out[v.name] = (shape, I32 if v.type.dtype == "i32" else F32)
    cfg = program.config
    for name in constant_names(program):
        size = cfg.rope_dim // 2 if name.startswith("const.rope.") else int(name.rsplit(".", 1)[1])
        out[name] = ((size,), F32)
    return [(name, shape, dtype) for name, (shape, dtype) in out.items()]


def constant_names(program: Program) -> list[str]:
    """The constants of the params tuple: both rope tables, and a ones vector per width of an
    unweighted norm (those kernels share the weighted ones' signature)."""
    dims = {n.inputs[0].type.shape[-1] for n in compiled_nodes(program)
            if (n.op == "rmsnorm" and len(n.inputs) == 1) or (n.op == "rmsnorm_rope" and len(n.inputs) == 2)}
    return [f"const.rope.{t}" for t in ("main", "compress")] + [f"const.ones.{d}" for d in sorted(dims)]


def build_step_module(program: Program, plan, geometry, kernels: dict[str, tirx.PrimFunc],
                      max_step_tokens: int, cuda_graph: bool = False) -> StepModule:
    """The IRModule of the entry functions (``entry_functions``) over ``kernels`` (symbol ->
    PrimFunc, already specialised for the target)."""
    for layer in program.config.mtp_layers:
        if layer.is_compressed:
            raise UnsupportedModelError(f"MTP layer {layer.index} is {layer.attention} (compress ratio "
                                        f"{layer.compress_ratio}); dsv4c compiles sliding-window MTP layers, "
                                        "as the official V4 checkpoints ship")
    per_node = {name: [node_kernels(node, program.config, plan) for node in fn.nodes]
                for name, fn in program.functions.items()}
    params = step_params(program, [roles for name in program.functions for roles in per_node[name]])
    bb = relax.BlockBuilder()
    gvars = {symbol: bb.add_func(func, symbol) for symbol, func in kernels.items()}
    functions = entry_functions(program, max_step_tokens)
    pool, ratios = None, None
    for name, (source, gemv, bound) in functions.items():
        emitter = _Emitter(bb, program, geometry, gvars, per_node, params, gemv, cuda_graph)
        emitter.function(name, source, bound)
        pool, ratios = emitter.pool_layout, emitter.ratios
    return StepModule(bb.get(), list(functions), [name for name, _, _ in params], pool, ratios, max_step_tokens)
