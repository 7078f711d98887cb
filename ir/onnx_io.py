"""IR <-> ONNX, so that V4's graphs open in Netron and feed ONNX tooling (docs/onnx.md).

The first function of the program (``step``) is the main graph; every other one (``mtp0``)
is a model-local ONNX function of the ``ai.dsv4c`` domain. ONNX names are the IR's
printed references (``%x`` values, ``@w`` weights, ``$x.shape`` constants), so a weight
can never collide with a value and the importer reads each name's role back from it.
The import gives back a program whose printed form equals the exported one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from dsv4c import __version__
from dsv4c.artifact.model_config import ModelConfig
from dsv4c.errors import IRError, UsageError
from dsv4c.ir.core import Function, Node, Program, Value
from dsv4c.ir.types import STATE, StateType, TensorType, Type

try:
    import onnx
    from onnx import TensorProto, helper, numpy_helper
except ModuleNotFoundError:
    raise UsageError("ONNX export needs the onnx package: pip install 'dsv4c[onnx]'") from None

DOMAIN = "ai.dsv4c"
# IR version 10 is the first whose functions carry value_info, which types mtp0's values.
IR_VERSION = 10
OPSETS = [helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)]

_DTYPES = {"f32": TensorProto.FLOAT, "i32": TensorProto.INT32, "i64": TensorProto.INT64}
_IR_DTYPES = {v: k for k, v in _DTYPES.items()}
# A state token carries no data; a rank-0 bool (a dtype the IR never uses) stands for it.
_STATE = TensorProto.BOOL


# --------------------------------------------------------------------------- export


def _value_info(v: Value) -> onnx.ValueInfoProto:
    if isinstance(v.type, StateType):
        return helper.make_tensor_value_info(v.ref, _STATE, [])
    return helper.make_tensor_value_info(v.ref, _DTYPES[v.type.dtype], list(v.type.shape))


def _attribute(key: str, v: Any) -> onnx.AttributeProto:
    items = v if isinstance(v, (list, tuple)) else [v]
    if len({type(x) for x in items}) > 1:
        raise IRError(f"attribute {key}={v!r} mixes types; ONNX lists hold one type")
    # ONNX has no bool attribute and its floats are 32-bit: a typed tensor keeps bools and
    # doubles such as 1e-06 exact; floats that fit 32 bits stay plain FLOAT(S) for readers.
    if any(isinstance(x, bool) or (isinstance(x, float) and float(np.float32(x)) != x) for x in items):
        return helper.make_attribute(key, numpy_helper.from_array(np.array(v)))
    try:
        return helper.make_attribute(key, v)
    except (ValueError, TypeError):
        raise IRError(f"attribute {key}={v!r} has no ONNX encoding") from None


def _node_protos(n: Node) -> list[onnx.NodeProto]:
    """The standard op where its semantics are exactly the IR op's, else an ai.dsv4c op."""
    ins, outs = [v.ref for v in n.inputs], [v.ref for v in n.outputs]
    if n.op == "embed":
        return [helper.make_node("Gather", ins[::-1], outs, name=outs[0])]
    if n.op == "add":
        return [helper.make_node("Add", ins, outs, name=outs[0])]
    if n.op == "reshape":
        # The token dim is kept (ops.reshape checks it): Reshape's 0 copies it, symbolic or not.
        shape = f"${n.outputs[0].name}.shape"
        return [helper.make_node("Constant", [], [shape], value_ints=[0, *n.attrs["shape"][1:]]),
                helper.make_node("Reshape", ins + [shape], outs, name=outs[0])]
    node = helper.make_node(n.op, ins, outs, name=outs[0], domain=DOMAIN)
    node.attribute.extend(_attribute(k, v) for k, v in n.attrs.items())
    return [node]


def _nodes(fn: Function) -> list[onnx.NodeProto]:
    return [p for n in fn.nodes for p in _node_protos(n)]


def _params(fn: Function) -> list[Value]:
    """Inputs, then weights: ONNX functions see no initializers, so weights are parameters."""
    return fn.inputs + list(fn.weights.values())


def program_to_onnx(program: Program, weights: dict[str, np.ndarray] | None = None,
                    stage: str = "traced") -> onnx.ModelProto:
    """The program as an ONNX model. Weights are typed graph inputs (a data-less initializer
    fails the checker); ``weights`` adds them as initializers too, every function's weights,
    by the names the functions take them as."""
    main, *others = program.functions.values()
    boundary = {id(v) for v in _params(main) + main.outputs}
    initializers = []
    if weights is not None:
        # Cast to the IR dtype the graph declares (a checkpoint may hold tid2eid as int64).
        types = {w.name: w.type for fn in program.functions.values() for w in fn.weights.values()}
        initializers = [numpy_helper.from_array(
            np.ascontiguousarray(weights[name], helper.tensor_dtype_to_np_dtype(_DTYPES[t.dtype])), "@" + name)
            for name, t in types.items()]
    graph = helper.make_graph(
        _nodes(main), main.name,
        inputs=[_value_info(v) for v in _params(main)],
        outputs=[_value_info(v) for v in main.outputs],
        initializer=initializers,
        value_info=[_value_info(o) for n in main.nodes for o in n.outputs if id(o) not in boundary])
    functions = [helper.make_function(DOMAIN, f.name, [v.ref for v in _params(f)], [v.ref for v in f.outputs],
                                      _nodes(f), OPSETS,
                                      value_info=[_value_info(v) for v in _params(f)]
                                      + [_value_info(o) for n in f.nodes for o in n.outputs])
                 for f in others]
    model = helper.make_model(graph, ir_version=IR_VERSION, opset_imports=OPSETS, functions=functions,
                              producer_name="dsv4c", producer_version=__version__,
                              doc_string=f"DeepSeek-V4 {program.config.name}: dsv4c IR ({stage})")
    helper.set_model_props(model, {"dsv4c.model": program.config.name, "dsv4c.numerics": program.numerics,
                                   "dsv4c.stage": stage, "dsv4c.config": json.dumps(program.config.to_json_dict("hf"))})
    return model


def write_onnx(program: Program, path: str | Path, weights: dict[str, np.ndarray] | None = None,
               stage: str = "traced") -> Path:
    """Write ``path``; with ``weights``, their data goes to ``<path>.data`` next to it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    model = program_to_onnx(program, weights, stage)
    if weights is None:
        onnx.save_model(model, path)
        return path
    data = path.with_name(path.name + ".data")
    data.unlink(missing_ok=True)  # onnx appends to an existing data file
    onnx.save_model(model, path, save_as_external_data=True, location=data.name, size_threshold=0)
    return path


# --------------------------------------------------------------------------- import


def _type(t: onnx.TypeProto) -> Type:
    tt = t.tensor_type
    if tt.elem_type == _STATE:
        return STATE
    if tt.elem_type not in _IR_DTYPES:
        raise IRError(f"ONNX element type {TensorProto.DataType.Name(tt.elem_type)} has no dsv4c IR dtype")
    return TensorType(_IR_DTYPES[tt.elem_type], tuple(getattr(d, d.WhichOneof("value")) for d in tt.shape.dim))


def _attr_value(a: onnx.AttributeProto) -> Any:
    v = helper.get_attribute_value(a)
    if isinstance(v, TensorProto):
        return numpy_helper.to_array(v).tolist()
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, list):
        return [x.decode() if isinstance(x, bytes) else x for x in v]
    return v


def _ir_node(p: onnx.NodeProto, env: dict[str, Value], consts: dict[str, list[int]]) -> tuple[str, list[Value], dict]:
    """The IR op, inputs and attributes of an ONNX node this module wrote."""
    if p.domain == DOMAIN:
        return p.op_type, [env[r] for r in p.input], {a.name: _attr_value(a) for a in p.attribute}
    if p.op_type == "Gather":
        return "embed", [env[p.input[1]], env[p.input[0]]], {}
    if p.op_type == "Add":
        return "add", [env[r] for r in p.input], {}
    if p.op_type == "Reshape":
        x = env[p.input[0]]
        return "reshape", [x], {"shape": [x.type.shape[0], *consts[p.input[1]][1:]]}
    raise IRError(f"ONNX op {p.op_type} ({p.domain or 'ai.onnx'}) has no dsv4c IR counterpart")


def _function(name: str, params: Iterable[str], nodes: Iterable[onnx.NodeProto], outputs: Iterable[str],
              infos: Iterable[onnx.ValueInfoProto]) -> Function:
    types = {vi.name: vi.type for vi in infos}
    fn = Function(name)
    env: dict[str, Value] = {}
    consts: dict[str, list[int]] = {}
    try:
        for ref in params:
            kind = {"%": "input", "@": "weight"}.get(ref[:1])
            if kind is None:
                raise IRError(f"@{name}: parameter {ref!r} is neither a %value nor a @weight")
            v = env[ref] = Value(ref[1:], _type(types[ref]), kind)
            if kind == "input":
                fn.inputs.append(v)
            else:
                fn.weights[v.name] = v
        for p in nodes:
            if p.op_type == "Constant":
                consts[p.output[0]] = list(p.attribute[0].ints)
                continue
            op, ins, attrs = _ir_node(p, env, consts)
            node = Node(op, ins, attrs, [])
            node.outputs = [Value(r[1:], _type(types[r]), "node", node) for r in p.output]
            env.update(zip(p.output, node.outputs))
            fn.nodes.append(node)
        fn.outputs = [env[r] for r in outputs]
    except KeyError as e:
        raise IRError(f"@{name}: {e.args[0]!r} is undefined or untyped") from None
    return fn


def program_from_onnx(model: onnx.ModelProto) -> Program:
    """The program an ONNX model written by :func:`program_to_onnx` holds, verified; the model
    config comes from the file's metadata."""
    from dsv4c.ir.verify import verify

    meta = {p.key: p.value for p in model.metadata_props}
    if "dsv4c.numerics" not in meta:
        raise IRError("not an ONNX model written by dsv4c (no dsv4c.numerics metadata)")
    config = ModelConfig.from_json_dict(json.loads(meta["dsv4c.config"]), meta["dsv4c.model"], "ONNX metadata")
    g = model.graph
    functions = [_function(g.name, [vi.name for vi in g.input], g.node, [vi.name for vi in g.output],
                           [*g.input, *g.output, *g.value_info])]
    functions += [_function(f.name, f.input, f.node, f.output, f.value_info) for f in model.functions]
    program = Program(config, {f.name: f for f in functions}, meta["dsv4c.numerics"])
    verify(program)
    return program


def read_onnx(path: str | Path) -> Program:
    """Import ``path`` (its external weight data, if any, is not read)."""
    return program_from_onnx(onnx.load_model(path, load_external_data=False))
