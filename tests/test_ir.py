"""The IR: tracing every preset, printing, verification failures."""

import copy

import pytest

from dsv4c.errors import IRError
from dsv4c.frontend.config import preset
from dsv4c.frontend.trace import trace
from dsv4c.ir.core import Builder, Function, Node, Program, Value
from dsv4c.ir.types import TensorType
from dsv4c.ir.ops import f32, i32
from dsv4c.ir.verify import verify


@pytest.mark.parametrize("name", ["tiny", "flash", "pro"])
def test_presets_trace_and_verify(name):
    cfg = preset(name)
    program = trace(cfg)
    step = program.functions["step"]
    counts = step.op_counts()
    assert counts["sparse_attn"] == counts["kv_write"] == cfg.num_layers
    assert counts["mhc_pre"] == counts["mhc_post"] == 2 * cfg.num_layers
    assert counts["index_score"] == sum(l.has_indexer for l in cfg.layers)
    assert counts["compress"] == sum(l.is_compressed for l in cfg.layers) + counts["index_score"]
    assert sorted(program.functions) == ["mtp0", "step"]


def test_printer_is_deterministic_and_readable():
    a, b = str(trace(preset("tiny"))), str(trace(preset("tiny")))
    assert a == b
    assert "func @step(%tokens: i32[T], %positions: i32[T], %seq_ids: i32[T])" in a
    assert "= sparse_attn(" in a and "kind=csa" in a and "@layers.1.attn.attn_sink" in a
    assert "func @mtp0(%streams: f32[T, 4, 64]" in a


def _tiny_fn():
    fn = Function("f")
    b = Builder(fn)
    x = b.input("x", f32("T", 8))
    w = b.weight("w", f32(4, 8))
    y = b.emit("linear", [x, w], {"quant": "fp32"}, "y")
    fn.outputs = [y]
    return fn


def _program(fn):
    return Program(preset("tiny"), {"f": fn})


def test_verifier_accepts_well_formed():
    verify(_program(_tiny_fn()))


def test_verifier_rejects_use_before_definition():
    fn = _tiny_fn()
    node = fn.nodes[0]
    z = Value("z", f32("T", 8), "node", None)
    node.inputs[0] = z
    with pytest.raises(IRError, match="before it is defined"):
        verify(_program(fn))


def test_verifier_rejects_wrong_recorded_type():
    fn = _tiny_fn()
    fn.nodes[0].outputs[0].type = f32("T", 5)
    with pytest.raises(IRError, match="inputs imply"):
        verify(_program(fn))


def test_verifier_rejects_shape_mismatch_and_unknown_op():
    fn = _tiny_fn()
    fn.weights["w"].type = f32(4, 9)
    with pytest.raises(IRError, match="reduction dim"):
        verify(_program(fn))
    fn = _tiny_fn()
    fn.nodes[0].op = "matmul_of_mystery"
    with pytest.raises(IRError, match="unknown op"):
        verify(_program(fn))


def test_verifier_rejects_missing_attribute_and_double_definition():
    fn = _tiny_fn()
    del fn.nodes[0].attrs["quant"]
    with pytest.raises(IRError, match="missing attribute 'quant'"):
        verify(_program(fn))
    fn = _tiny_fn()
    dup = fn.nodes[0]
    again = Node(dup.op, dup.inputs, dup.attrs, [])
    again.outputs = [Value("y", dup.outputs[0].type, "node", again)]
    fn.nodes.append(again)
    with pytest.raises(IRError, match="defined twice"):
        verify(_program(fn))


def test_sparse_attn_arity_follows_layer_kind():
    program = trace(preset("tiny"))
    node = next(n for n in program.functions["step"].nodes if n.op == "sparse_attn" and n.attrs["kind"] == "csa")
    node.inputs.pop()  # drop the top-k
    with pytest.raises(IRError, match="takes 7 inputs"):
        verify(program)
