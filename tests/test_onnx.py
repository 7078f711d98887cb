"""ONNX export / import (docs/onnx.md): checker, exact round trip, attributes, weights, CLI."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import AttributeProto, TensorProto, numpy_helper  # noqa: E402

from dsv4c.cli import main  # noqa: E402
from dsv4c.errors import IRError  # noqa: E402
from dsv4c.frontend.checkpoint import load_weights  # noqa: E402
from dsv4c.frontend.config import preset, resolve_model  # noqa: E402
from dsv4c.frontend.trace import trace  # noqa: E402
from dsv4c.ir.onnx_io import DOMAIN, program_from_onnx, program_to_onnx, read_onnx  # noqa: E402
from dsv4c.passes.merge_projections import base_weight_names, materialize_weights  # noqa: E402
from dsv4c.passes.pipeline import run_pipeline  # noqa: E402


def _program(name: str, after_passes: bool, numerics: str = "exact"):
    program = trace(preset(name), numerics)
    return run_pipeline(program) if after_passes else program


def _round_trip(program):
    return program_from_onnx(onnx.load_model_from_string(program_to_onnx(program).SerializeToString()))


@pytest.mark.parametrize("name", ["tiny", "pro", "flash"])
@pytest.mark.parametrize("after_passes", [False, True])
def test_checker_passes(name, after_passes):
    # full_check also runs strict shape inference: the standard ops agree with the stored shapes.
    onnx.checker.check_model(program_to_onnx(_program(name, after_passes)), full_check=True)


@pytest.mark.parametrize("name, numerics", [("tiny", "exact"), ("tiny", "qat"), ("pro", "exact")])
@pytest.mark.parametrize("after_passes", [False, True])
def test_round_trip_prints_identically(name, numerics, after_passes):
    program = _program(name, after_passes, numerics)
    back = _round_trip(program)
    assert list(back.functions) == ["step", "mtp0"]
    assert str(back) == str(program)


def test_graph_layout():
    program = _program("tiny", after_passes=True)
    model = program_to_onnx(program)
    assert {(o.domain, o.version) for o in model.opset_import} == {("", 21), (DOMAIN, 1)}
    g = model.graph
    assert g.name == "step" and not g.initializer
    assert [f"{f.domain}::{f.name}" for f in model.functions] == [f"{DOMAIN}::mtp0"]
    ops = {(n.domain, n.op_type) for n in g.node}
    assert {("", "Gather"), ("", "Add"), ("", "Reshape"), ("", "Constant")} <= ops
    assert {(DOMAIN, "mhc_seam"), (DOMAIN, "mhc_post_head"), (DOMAIN, "linear_split"), (DOMAIN, "compress"),
            (DOMAIN, "index_topk"), (DOMAIN, "sparse_attn"), (DOMAIN, "moe_route")} <= ops
    # Weights are typed graph inputs; symbolic dims are dim_params; state tokens rank-0 bools.
    inputs = {vi.name: vi.type.tensor_type for vi in g.input}
    assert [d.dim_param for d in inputs["%tokens"].shape.dim] == ["T"]
    assert [d.dim_value for d in inputs["@embed.weight"].shape.dim] == list(program.functions["step"].weights[
        "embed.weight"].type.shape)
    infos = {vi.name: vi.type.tensor_type for vi in g.value_info}
    assert infos["%l1.index.scores"].shape.dim[1].dim_param == "E"
    state = infos["%l1.main.entries"]
    assert state.elem_type == TensorProto.BOOL and len(state.shape.dim) == 0


def test_attributes_are_exact():
    program = _program("tiny", after_passes=True)
    step = program.functions["step"]
    rmsnorm = next(n for n in step.nodes if n.op == "rmsnorm")
    rmsnorm.attrs["eps"] = 0.11180339887498948
    protos = {n.name: n for n in program_to_onnx(program).graph.node}

    def attr(node, key):
        return next(a for a in protos[node.outputs[0].ref].attribute if a.name == key)

    def first(op):
        return next(n for n in step.nodes if n.op == op)

    # Doubles that a 32-bit float would round and bools are typed tensors; the rest plain attributes.
    assert attr(rmsnorm, "eps").type == AttributeProto.TENSOR
    assert attr(first("mhc_seam"), "hc_eps").t.data_type == TensorProto.DOUBLE  # 1e-06
    assert attr(first("rope"), "inverse").t.data_type == TensorProto.BOOL
    assert attr(first("moe_route"), "scale").type == AttributeProto.FLOAT  # 1.5
    assert attr(first("linear_split"), "sizes").type == AttributeProto.INTS
    assert attr(first("linear"), "quant").type == AttributeProto.STRING

    back = _round_trip(program)
    for fn in program.functions:
        for a, b in zip(program.functions[fn].nodes, back.functions[fn].nodes, strict=True):
            assert [(k, type(v), v) for k, v in a.attrs.items()] == [(k, type(v), v) for k, v in b.attrs.items()]
    assert repr(next(n for n in back.functions["step"].nodes if n.op == "rmsnorm").attrs["eps"]) == \
        "0.11180339887498948"
    assert "{eps=1e-06}" in str(back)


def test_mixed_list_attribute_is_refused():
    program = _program("tiny", after_passes=True)
    next(n for n in program.functions["step"].nodes if n.op == "linear_split").attrs["sizes"] = [1, "a"]
    with pytest.raises(IRError, match="mixes types"):
        program_to_onnx(program)


def test_pro_export_is_small_and_fast(tmp_path, capsys):
    out = tmp_path / "pro.onnx"
    start = time.perf_counter()
    assert main(["export", "--model", "pro", "--format", "onnx", "-o", str(out)]) == 0
    elapsed = time.perf_counter() - start
    assert out.stat().st_size < 10 * 10**6
    assert elapsed < 30
    assert str(read_onnx(out)) == str(trace(preset("pro")))


def test_with_weights_round_trip(tmp_path, capsys):
    model, out = tmp_path / "tiny-model", tmp_path / "out" / "tiny.onnx"
    assert main(["make-tiny", "--out", str(model)]) == 0
    assert main(["export", "--model", str(model), "--format", "onnx", "--after-passes", "--target", "sm90",
                 "--with-weights", "-o", str(out)]) == 0
    assert (out.parent / "tiny.onnx.data").is_file()
    onnx.checker.check_model(str(out), full_check=True)  # also finds every tensor's external data

    cfg = resolve_model(str(model))
    program = run_pipeline(trace(cfg))
    expected = materialize_weights(program, load_weights(cfg, model, base_weight_names(program)))
    loaded = onnx.load(str(out))
    assert all(t.data_location == TensorProto.EXTERNAL for t in onnx.load(str(out), load_external_data=False)
               .graph.initializer)
    got = {t.name: numpy_helper.to_array(t) for t in loaded.graph.initializer}
    assert sorted(got) == sorted("@" + k for k in expected)  # mtp0's weights included
    for name, value in expected.items():
        np.testing.assert_array_equal(got["@" + name], value)
    assert str(read_onnx(out)) == str(program)
    assert dict((p.key, p.value) for p in loaded.metadata_props)["dsv4c.stage"] == "after passes for sm90"


@pytest.mark.parametrize("argv, message", [
    (["--model", "tiny", "--format", "netron"], "unknown export format 'netron'"),
    (["--model", "no-such-model", "--format", "onnx"], "neither a preset"),
    (["--model", "tiny", "--format", "onnx", "--target", "llvm"], "--target only applies with --after-passes"),
    (["--model", "tiny", "--format", "onnx", "--after-passes", "--target", "x86"], "unknown target 'x86'"),
    (["--model", "tiny", "--format", "onnx", "--with-weights"], "--with-weights needs a model directory"),
])
def test_usage_errors_are_one_line(tmp_path, capsys, argv, message):
    out = tmp_path / "m.onnx"
    assert main(["export", *argv, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsv4c: error: ") and message in err and err.count("\n") == 1
    assert not out.exists()


def test_missing_onnx_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx", None)  # makes `import onnx` fail
    monkeypatch.delitem(sys.modules, "dsv4c.ir.onnx_io")
    assert main(["export", "--model", "tiny", "--format", "onnx", "-o", str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err
    assert "pip install 'dsv4c[onnx]'" in err and err.count("\n") == 1


def test_foreign_models_are_refused():
    model = program_to_onnx(_program("tiny", after_passes=False))
    model.graph.node[0].op_type = "MatMul"
    with pytest.raises(IRError, match="MatMul .* has no dsv4c IR counterpart"):
        program_from_onnx(model)
    del model.metadata_props[:]
    with pytest.raises(IRError, match="not an ONNX model written by dsv4c"):
        program_from_onnx(model)
