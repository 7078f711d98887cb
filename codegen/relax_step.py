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
from math import prod

import tvm
from tvm import relax, tirx

from dsv4c.artifact.engram_tables import table_format, table_inputs, table_tensors
from dsv4c.artifact.pool import ENVELOPE_TOKENS, PoolGeometry, PoolTensor, graph_context_limit
from dsv4c.artifact.quant import WEIGHT_FORMATS
from dsv4c.codegen.kernels.matmul import GEMM_ROWS
from dsv4c.codegen.lowering import GRAPH_COPY_KERNELS, compiled_nodes, engram_table_names, node_kernels
from dsv4c.codegen.ops.base import F32, I32, KernelSpec, weight_quant
from dsv4c.codegen.ops.registry import lowering_of
from dsv4c.errors import UnsupportedModelError
from dsv4c.ir.core import Program
from dsv4c.ir.cost import node_families

GEMV_MAX_ROWS = 4  # steps with at most this many tokens run the decode function
# The step's inputs, in the entry functions' argument order (before params and pool).
STEP_INPUTS = ("tokens", "positions", "token_request", "requests", "block_table", "logit_rows", "entry_extents")
# An MTP function's inputs after those: the streams it starts from (a step's, or its own output
# when drafts chain) and which of their rows each token takes. Its ``tokens`` are the tokens
# of the next positions (docs/v4.md, "Forward pass"). DSpark's Markov function takes them too:
# rows of the last draft's y, its ``tokens`` each row's previous token.
MTP_INPUTS = ("streams", "stream_rows")
# A V4.1 model that sees images: the prefill function's inputs after the others (the rows of
# the image spans the step feeds, [I, D], and each token's row of them or -1, [T]); the decode
# function takes none.
IMAGE_INPUTS = ("image_rows", "image_index")


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
    # Per entry function, the families (``ir.cost.node_families``) of each kernel call it makes,
    # in the order the VM runs them: how ``runtime.profile`` attributes a call's time.
    call_families: dict[str, list[dict[str, float]]]
    cuda_graph: bool  # decode functions replay captured CUDA graphs


class _Emitter:
    """Emits one entry function: IR nodes in order, each as its kernel calls, which its op's
    lowering (``ops.registry``) emits through the helpers here. Lowerings also read the
    function's state: ``inputs`` (the step inputs by name), ``t`` / ``r`` (token and request
    counts), ``entries`` (compress ratio -> entry extent), ``pool`` (pool tensor name -> its
    current version), ``pool_layout``, ``pool_rows``, ``geometry``, ``cfg`` and ``gemv``."""

    def __init__(self, bb: relax.BlockBuilder, program: Program, geometry, gvars: dict, per_node: dict[str, list],
                 params: list[tuple[str, tuple, str]], gemv: bool, cuda_graph: bool):
        self.bb, self.program, self.cfg, self.geometry = bb, program, program.config, geometry
        self.gvars, self.per_node, self.gemv, self.cuda_graph = gvars, per_node, gemv, cuda_graph
        self.param_index = {name: i for i, (name, _, _) in enumerate(params)}
        self.param_types = [(shape, dtype) for _, shape, dtype in params]
        self._params: dict[str, relax.Var] = {}
        self.call_families: list[dict[str, float]] = []
        self.families = {"other": 1.0}  # the node being emitted's (step bookkeeping before any node)

    # ------------------------------------------------------------------ helpers
    def call(self, kernel: KernelSpec | str, args: list, out) -> relax.Var:
        """call_tir of a kernel (a spec, or a generic kernel's name); ``out`` is one (shape,
        dtype) or a list of them."""
        outs = [relax.TensorType(list(s), d) for s, d in (out if isinstance(out, list) else [out])]
        return self.bb.emit(relax.call_tir(self._callee(kernel), args, outs if isinstance(out, list) else outs[0]))

    def call_packed(self, function: str, args: list, out) -> relax.Var:
        """A global function the runtime registers (a collective), destination-passing: it
        writes its one output ``out`` (shape, dtype). Not a kernel: profiles leave it out."""
        return self.bb.emit(relax.call_dps_packed(relax.ExternFunc(function), args, relax.TensorType(list(out[0]), out[1])))

    def _callee(self, kernel: KernelSpec | str):
        """The kernel's global var, for a call emitted now (recorded with the node's families)."""
        self.call_families.append(self.families)
        return self.gvars[kernel if isinstance(kernel, str) else kernel.symbol]

    def call_inplace(self, kernel: KernelSpec, args: list, written: list[int]) -> list[relax.Var]:
        """call_tir_inplace writing ``args[i]`` for i in ``written``: the new versions of those."""
        types = [args[i].ty for i in written]
        out = self.bb.emit(relax.call_tir_inplace(self._callee(kernel), args, written,
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
        scaled = WEIGHT_FORMATS[weight_quant(kernel)].scaled
        return [self.param(name)] + ([self.param(name + ".scale")] if scaled else [])

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
        n, groups, width = shape[0], int(prod(lead)), shape[-1]
        blocks = tirx.floordiv(n + GEMM_ROWS - 1, GEMM_ROWS)
        padded = self.call("pad_rows", [self.view(x, [n, groups, width])], ([groups, blocks * GEMM_ROWS, width], F32))
        y = self.call(roles[prefix + "gemm"], [self.view(padded, lead + [blocks, GEMM_ROWS, width])] + weight,
                      ([blocks, GEMM_ROWS] + lead + [out_dim], F32))
        return self.view(y, [n] + lead + [out_dim])

    def _graph_copy(self, x: relax.Var, dtype: str) -> relax.Var:
        """``x`` (a vector or a matrix) copied by ``step_kernels.copy_rows``: a CUDA graph replays
        its kernels on the addresses it captured, so the step copies its inputs (new arrays every
        step) into buffers of its own first and its outputs (new tensors) out of its own last."""
        shape = self.shape(x)
        rows = [shape[0], prod(shape[1:]) if len(shape) > 1 else 1]
        spec = GRAPH_COPY_KERNELS[dtype]
        return self.view(self.call(spec.symbol, [self.view(x, rows)], (rows, dtype)), shape)

    # ------------------------------------------------------------------ function
    def function(self, name: str, source: str, max_tokens: int) -> None:
        """Emit entry function ``name`` running IR function ``source``; it returns the IR
        function's two outputs: (the logits of the requested rows, the last streams: the
        backbone's last layer for ``step``, the MTP layer's own for an MTP function), for
        DSpark's ``dspark_draft`` (the base logits, the head's hidden rows y) and
        ``dspark_markov`` (the Markov bias, the confidence logits or, without a confidence head,
        the Markov embeddings). A function with a ``streams`` input also takes ``stream_rows``
        (MTP_INPUTS)."""
        cfg, bb = self.cfg, self.bb
        t, r, b, lr, s = (tirx.Var(v, "int64") for v in ("T", "R", "B", "L", "S"))
        self.ratios = sorted({layer.compress_ratio for layer in cfg.layers if layer.is_compressed})
        extents = [tirx.Var(f"E{ratio}", "int64") for ratio in self.ratios]
        self.entries = dict(zip(self.ratios, extents))
        self.t, self.r = t, r
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
        streams = next((v for v in fn.inputs if v.name == "streams"), None)
        if streams is not None:  # an MTP layer's [*, hc, D] or DSpark's Markov head's [*, D]
            row_shape = list(streams.type.shape[1:])
            inputs["streams"] = relax.Var("streams", relax.TensorType([s] + row_shape, F32))
            inputs["stream_rows"] = relax.Var("stream_rows", relax.TensorType([t], I32))
        rows_in = next((v for v in fn.inputs if v.name == "engram_rows"), None)
        if rows_in is not None:  # V4.1's Engram table rows of every token, hashed on the host, and the tables
            inputs["engram_rows"] = relax.Var("engram_rows", relax.TensorType([t] + list(rows_in.type.shape[1:]), I32))
            inputs.update((name, relax.Var(name, relax.TensorType(shape, dtype)))
                          for name, (shape, dtype) in engram_table_inputs(cfg).items())
        if not self.gemv and any(v.name == "image_index" for v in fn.inputs):
            inputs["image_rows"] = relax.Var("image_rows", relax.TensorType([tirx.Var("I", "int64"),
                                                                            cfg.hidden_size], F32))
            inputs["image_index"] = relax.Var("image_index", relax.TensorType([t], I32))
        self.inputs = inputs
        self.params_var = relax.Var("params", relax.TupleType(
            [relax.TensorType(list(shape), dtype) for shape, dtype in self.param_types]))
        self.pool_layout = self.geometry.tensors()
        pool_var, sizes = pool_parameter(self.pool_layout)
        self.pool_rows = sizes["main"]
        bounds = {"T": max_tokens, "R": max_tokens, "L": max_tokens, "S": max(max_tokens, GEMV_MAX_ROWS),
                  "I": max_tokens}
        attrs = {"tir_var_upper_bound": bounds, "relax.force_pure": True}
        if self.gemv and self.cuda_graph:
            # Decode steps replay one CUDA graph per (tokens, requests, logit rows, context
            # bucket): the runtime pads the block tables and entry extents to the bucket of the
            # context (artifact.pool.context_bucket), bounded here by that of the model's
            # positions so the memory plan stays static. The inputs after the step's own are the
            # weights and the pool, the same tensors every call (``num_input``).
            context = graph_context_limit(cfg)
            # The host gathers such a step's Engram rows into tables of T * C rows (runtime.backend_tvm).
            table_rows = [str(v.ty.shape.values[0]) for name, v in inputs.items() if name.startswith("engram_table.")]
            attrs["relax.rewrite_cuda_graph.capture_symbolic_vars"] = \
                ["T", "R", "L", "B"] + [f"E{ratio}" for ratio in self.ratios] + table_rows
            bounds.update({"B": context // ENVELOPE_TOKENS, **{f"E{ratio}": context // ratio for ratio in self.ratios},
                           **{rows: max_tokens * cfg.engram.columns for rows in table_rows}})
            attrs["num_input"] = len(inputs)
        with bb.function(name, list(inputs.values()) + [self.params_var, pool_var], attrs=attrs):
            if self.gemv and self.cuda_graph:
                inputs = self.inputs = {name: self._graph_copy(v, str(v.ty.dtype)) if graph_copied(name) else v
                                        for name, v in inputs.items()}
            self.pool = dict(zip((p.name for p in self.pool_layout),
                                 pool_row_views(bb, pool_var, self.pool_layout, sizes)))
            env: dict[int, relax.Var] = {}
            # The IR function's inputs by name (seq_ids: the kernels read token_request); an
            # MTP layer's ``next_tokens`` are its ``tokens``.
            for v in fn.inputs:
                if v is streams:
                    width = prod(row_shape)
                    rows = self.call("gather_rows", [self.view(inputs["streams"], [s, width]),
                                                     inputs["stream_rows"]], ([t, width], F32))
                    env[id(v)] = self.view(rows, [t] + row_shape)
                elif v.name in ("tokens", "next_tokens", "positions"):
                    env[id(v)] = inputs["positions" if v.name == "positions" else "tokens"]
            for node, roles in zip(fn.nodes, self.per_node[source]):
                self.families = node_families(node)
                outs = lowering_of(node.op).emit(self, node, roles, [env.get(id(v)) for v in node.inputs])
                for o, val in zip(node.outputs, outs):
                    env[id(o)] = val
            # The logits: of the rows logit_rows names only (the head gathers them first).
            outputs = [env[id(fn.outputs[0])], env[id(fn.outputs[1])]]
            if self.gemv and self.cuda_graph:
                outputs = [self._graph_copy(x, F32) for x in outputs]
            bb.emit_func_output(relax.Tuple(outputs))


# The step inputs a captured decode step reads from copies of its own (``_Emitter._graph_copy``),
# and every Engram table input (``engram_table_inputs``).
GRAPH_INPUT_COPIES = ("tokens", "positions", "token_request", "requests", "block_table", "logit_rows", "stream_rows",
                      "engram_rows")


def graph_copied(name: str) -> bool:
    """Whether a captured decode step reads step input ``name`` from a copy of its own."""
    return name in GRAPH_INPUT_COPIES or name.startswith(("engram_table.", "engram_scale."))


def engram_table_inputs(cfg) -> dict[str, tuple[list, str]]:
    """The step's Engram table inputs after ``engram_rows``, in order (``artifact.engram_tables``:
    per Engram layer L, ``engram_table.L`` ``[R_L, de]`` uint8 codes or float32 and, FP8 only,
    ``engram_scale.L`` ``[R_L, ceil(de / 32)]`` uint8): name -> (shape, dtype), R_L symbolic
    (the whole table on the CPU, a step's gather of it elsewhere)."""
    fmt, out = table_format(cfg), {}
    for layer in cfg.engram.layer_ids:
        tensors = table_tensors(fmt, tirx.Var(f"table_rows_{layer}", "int64"), cfg.engram.head_dim)
        for name, (dtype, shape) in zip(table_inputs(layer, fmt), tensors.values()):
            out[name] = (list(shape), {"U8": "uint8", "F32": F32}[dtype])
    return out


def pool_parameter(layout: list[PoolTensor]) -> tuple[relax.Var, dict[str, tirx.Var]]:
    """An entry function's ``pool`` parameter: the tuple of ``layout``'s tensors, and the sizes
    of their row spaces by ``PoolTensor.rows`` (``main``: pool_rows, ``index``, ``slots``)."""
    sizes = {rows: tirx.Var(name, "int64") for rows, name in
             (("main", "pool_rows"), ("index", "index_rows"), ("slots", "slots"))}
    return relax.Var("pool", relax.TupleType([relax.TensorType([sizes[p.rows]] + list(p.shape), p.dtype)
                                              for p in layout])), sizes


def pool_row_views(bb: relax.BlockBuilder, pool_var: relax.Var, layout: list[PoolTensor], sizes: dict,
                   widths: list[int] | None = None) -> list[relax.Var]:
    """Each pool tensor as rows of its elements in order, [rows, width] (width: its last axis, or
    ``widths[i]``): a ring tensor [slots, ring rows, width] as [slots * ring rows, width], slot s
    owning rows [s * ring rows, (s + 1) * ring rows)."""
    out = []
    for i, p in enumerate(layout):
        v = bb.emit(relax.TupleGetItem(pool_var, i))
        width = p.shape[-1] if widths is None else widths[i]
        if p.rows == "slots" or width != p.shape[-1]:
            v = bb.emit(relax.op.memory.view(v, relax.ShapeExpr([sizes[p.rows] * (prod(p.shape) // width), width])))
        out.append(v)
    return out


# The functions that save and restore pool rows on the artifact's device (speculative decoding
# puts back the rows rejected drafts wrote), by role.
POOL_FUNCTIONS = {"save": "pool_save", "restore": "pool_restore"}


def emit_pool_functions(bb: relax.BlockBuilder, gvars: dict, geometry: PoolGeometry) -> None:
    """``pool_save(pool, rows)``: per pool tensor, seen as rows (``pool_row_views``; a tensor
    whose rows are scattered, ``PoolGeometry.bytewise``, as rows of one byte), the rows
    ``rows[i]`` (``i32[n_i]``) names, as fresh tensors; ``pool_restore(pool, rows, saved)`` writes
    such rows back in place. A row of -1 is no row: the host pads a tensor with nothing to save
    with one (``step_kernels.gather_rows`` / ``scatter_rows``), so no tensor is empty."""
    from dsv4c.codegen.lowering import pool_row_kernels

    layout = geometry.tensors()
    widths = [1 if geometry.bytewise(p) else p.shape[-1] for p in layout]
    for role, name in POOL_FUNCTIONS.items():
        pool_var, sizes = pool_parameter(layout)
        counts = [tirx.Var(f"n{i}", "int64") for i in range(len(layout))]
        rows_var = relax.Var("rows", relax.TupleType([relax.TensorType([n], I32) for n in counts]))
        saved_types = [relax.TensorType([n, w], p.dtype) for n, w, p in zip(counts, widths, layout)]
        saved_var = relax.Var("saved", relax.TupleType(saved_types))
        with bb.function(name, [pool_var, rows_var] + ([saved_var] if role == "restore" else []),
                         attrs={"relax.force_pure": True}):
            outs = []
            for i, view in enumerate(pool_row_views(bb, pool_var, layout, sizes, widths)):
                kernel = gvars[pool_row_kernels(layout[i].dtype)[role].symbol]
                rows = bb.emit(relax.TupleGetItem(rows_var, i))
                if role == "save":
                    outs.append(bb.emit(relax.call_tir(kernel, [view, rows], saved_types[i])))
                else:
                    saved = bb.emit(relax.TupleGetItem(saved_var, i))
                    bb.emit(relax.call_tir_inplace(kernel, [view, rows, saved], [0], view.ty))
            bb.emit_func_output(relax.Tuple(outs))


def step_params(program: Program, per_node: list[dict]) -> list[tuple[str, tuple, str]]:
    """(name, shape, dtype) of each tensor in the params tuple: every stored weight the step
    reads (a matmul weight as its kernel reads it, ``kernels.formats.TirFormat.parts``: its codes or
    values, then ``<name>.scale``), then the constants (``constant_names``)."""
    from dsv4c.codegen.kernels.formats import tir_format

    out: dict[str, tuple[tuple, str]] = {}
    tables = engram_table_names(program)  # step inputs, not params
    for node, roles in zip(compiled_nodes(program), per_node):
        lowering = lowering_of(node.op)
        matmul = lowering.matmul_weights(node)
        for v in node.inputs:
            if v.kind != "weight" or v.name in out or v.name in tables:
                continue
            shape = tuple(v.type.shape)
            if any(v is m for m in matmul):
                groups = lowering.weight_groups(node)
                lead = (groups,) if groups > 1 else shape[:-2]
                parts = tir_format(weight_quant(roles[lowering.weight_role])).parts(shape[-2] // groups, shape[-1])
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
    dims = {width for n in compiled_nodes(program) if (width := lowering_of(n.op).ones_width(n)) is not None}
    return [f"const.rope.{t}" for t in ("main", "compress")] + [f"const.ones.{d}" for d in sorted(dims)]


def build_step_module(program: Program, plan, geometry, kernels: dict[str, tirx.PrimFunc],
                      max_step_tokens: int, cuda_graph: bool = False, extra_params=(),
                      emit_extra=None) -> StepModule:
    """The IRModule of the entry functions (``entry_functions``) over ``kernels`` (symbol ->
    PrimFunc, already specialised for the target). ``extra_params`` (name, shape, dtype) follow
    the step's in the params tuple and ``emit_extra(bb, gvars, params)`` adds functions of its
    own that read them (``codegen.relax_vision``'s encode_image)."""
    for layer in program.config.mtp_layers:
        if layer.is_compressed:
            raise UnsupportedModelError(f"MTP layer {layer.index} is {layer.attention} (compress ratio "
                                        f"{layer.compress_ratio}); dsv4c compiles sliding-window MTP layers, "
                                        "as the official V4 checkpoints ship")
    per_node = {name: [node_kernels(node, program.config, plan) for node in fn.nodes]
                for name, fn in program.functions.items()}
    params = step_params(program, [roles for name in program.functions for roles in per_node[name]]) + \
        list(extra_params)
    bb = relax.BlockBuilder()
    gvars = {symbol: bb.add_func(func, symbol) for symbol, func in kernels.items()}
    functions = entry_functions(program, max_step_tokens)
    pool, ratios, call_families = None, None, {}
    for name, (source, gemv, bound) in functions.items():
        emitter = _Emitter(bb, program, geometry, gvars, per_node, params, gemv, cuda_graph)
        emitter.function(name, source, bound)
        pool, ratios, call_families[name] = emitter.pool_layout, emitter.ratios, emitter.call_families
    emit_pool_functions(bb, gvars, geometry)
    if emit_extra is not None:
        emit_extra(bb, gvars, params)
    return StepModule(bb.get(), list(functions), [name for name, _, _ in params], pool, ratios, max_step_tokens,
                      call_families, cuda_graph)
