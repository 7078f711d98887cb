"""Pass pipeline: mHC seam fusion, projection merge, quantization plans, pass manager options."""

import io
import json
from dataclasses import replace
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from dsv4c.cli import main as cli
from dsv4c.errors import UsageError
from dsv4c.artifact import lowbit
from dsv4c.frontend.checkpoint import load_weights
from dsv4c.frontend.config import config_from_dict, preset
from dsv4c.frontend.trace import trace
from dsv4c.ir.interpreter import Interpreter
from dsv4c.ir.verify import verify
from dsv4c.passes.cleanup import eliminate_dead_code
from dsv4c.passes.fuse_mhc import fuse_mhc_seams
from dsv4c.passes.fuse_norm_rope import fuse_norm_rope
from dsv4c.passes.merge_projections import materialize_weights, merge_projections
from dsv4c.passes.pipeline import PipelineOptions, run_pipeline
from dsv4c.passes.quant_plan import plan_for
from dsv4c.targets import COMPILED_TARGETS
from dense_cache import DenseCache

from parity_configs import PARITY_CONFIGS
from reference_harness import fp32_checkpoint

GOLDEN = Path(__file__).parent / "golden"


def test_seam_fusion_op_counts_on_pro():
    program = trace(preset("pro"))
    before = program.functions["step"].op_counts()
    fused = fuse_mhc_seams(program).functions["step"].op_counts()
    verify(program)
    seams = 2 * 61
    assert before["mhc_pre"] == before["mhc_post"] == seams
    # One fused op per seam, except layer 0's attention seam (no earlier post); the last
    # post folds into hc_head.
    assert fused["mhc_seam"] == seams - 1
    assert fused["mhc_pre"] == 1 and fused.get("mhc_post", 0) == 0
    assert fused["mhc_post_head"] == 1 and fused.get("hc_head", 0) == 0


def test_verbose_compile_prints_op_counts(tmp_path, capsys):
    assert cli(["compile", "--model", "pro", "--target", "reference", "--no-weights", "-o", str(tmp_path / "a"),
                "--verbose"]) == 0
    err = capsys.readouterr().err
    traced = trace(preset("pro"))
    n = sum(len(f.nodes) for f in traced.functions.values())
    fused = n - 121 - 1 - 2  # 121 seams + 1 post_head, and MTP's two seams: 1 fused, 1 into its head
    assert f"traced program: {n} ops" in err
    assert f"fuse-mhc-seams: {n} -> {fused} ops" in err


def test_projection_merge_groups_same_input_same_storage():
    program = merge_projections(trace(preset("flash")))
    verify(program)
    names = [w for w in program.functions["step"].weights if w.startswith("concat(")]
    assert "concat(layers.0.attn.wq_a.weight,layers.0.attn.wkv.weight)" in names
    csa = next(l.index for l in preset("flash").layers if l.has_indexer)
    p = f"layers.{csa}.attn."
    assert (f"concat({p}compressor.wkv.weight,{p}compressor.wgate.weight,{p}indexer.compressor.wkv.weight,"
            f"{p}indexer.compressor.wgate.weight,{p}indexer.weights_proj.weight)") in names
    assert f"concat({p}wq_b.weight,{p}indexer.wq_b.weight)" in names


def test_fp8_merge_requires_block_aligned_rows():
    # The tiny preset's wq_a has 32 rows: merging it with wkv would put two weights' rows in
    # one 128x128 scale block, so FP8 projections stay separate; BF16 ones still merge.
    program = merge_projections(trace(preset("tiny")))
    names = list(program.functions["step"].weights)
    assert not any("wq_a" in n and n.startswith("concat(") for n in names)
    assert any("compressor.wkv" in n and n.startswith("concat(") for n in names)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    cfg = config_from_dict(PARITY_CONFIGS["mixed_hc4"], "m")
    path = tmp_path_factory.mktemp("m") / "ckpt"
    cfg = fp32_checkpoint(cfg, path)
    return cfg, load_weights(cfg, path)


def _logits(program, weights, tokens, chunks):
    interp = Interpreter(program, materialize_weights(program, weights), DenseCache(program.config))
    out, start = [], 0
    for c in chunks:
        logits, streams = interp.run("step", tokens=tokens[start:start + c], positions=np.arange(start, start + c),
                                     seq_ids=np.zeros(c))
        out.append(logits)
        start += c
    return np.concatenate(out)


@pytest.mark.parametrize("pass_fn, exact", [(fuse_mhc_seams, True), (merge_projections, False),
                                            (fuse_norm_rope, True), (eliminate_dead_code, True)])
def test_each_pass_preserves_logits(model, pass_fn, exact):
    cfg, weights = model
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 80)
    chunks = [50, 7] + [1] * 23
    before = _logits(trace(cfg), weights, tokens, chunks)
    after_program = pass_fn(trace(cfg))
    verify(after_program)
    after = _logits(after_program, weights, tokens, chunks)
    if exact:  # only structure changed
        assert np.array_equal(before, after)
    else:  # one GEMM instead of several re-associates nothing per column, but BLAS may block differently
        assert np.abs(before - after).max() <= 1e-5


def test_whole_pipeline_preserves_logits(model):
    cfg, weights = model
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, 60)
    before = _logits(trace(cfg), weights, tokens, [60])
    after = _logits(run_pipeline(trace(cfg)), weights, tokens, [60])
    assert np.abs(before - after).max() <= 1e-5


def test_pass_manager_options():
    stream = io.StringIO()
    program = run_pipeline(trace(preset("tiny")), PipelineOptions(
        disable={"merge-projections"}, print_ir_after={"fuse-mhc-seams"}, verbose=True, stream=stream))
    text = stream.getvalue()
    assert "// ----- IR after fuse-mhc-seams" in text and "mhc_seam(" in text
    assert "merge-projections: disabled" in text
    assert "linear_split" not in str(program)
    stream = io.StringIO()
    run_pipeline(trace(preset("tiny")), PipelineOptions(print_ir_after_all=True, stream=stream))
    assert stream.getvalue().count("// ----- IR after") == 4
    with pytest.raises(UsageError, match="unknown pass"):
        run_pipeline(trace(preset("tiny")), PipelineOptions(disable={"no-such-pass"}))


@pytest.mark.parametrize("model_name", ["pro", "flash"])
@pytest.mark.parametrize("target", COMPILED_TARGETS)
def test_golden_quant_plans(model_name, target):
    plan = plan_for(preset(model_name), target).to_json()
    golden = json.loads((GOLDEN / f"quant_plan_{model_name}_{target}.json").read_text())
    assert json.loads(json.dumps(plan)) == golden
    # The table of docs/v4.md, "Formats per target", spelled out.
    assert plan["fp8_format"] == ("e4m3fnuz" if target == "gfx942" else "e4m3fn")
    assert plan["index_kv"]["row_bytes"] == {"gfx950": 68, "gfx942": 132, "sm90": 132}.get(target, 512)
    if target == "gfx950":
        assert plan["weights"]["expert"]["storage"] == "fp4" and plan["index_kv"]["hadamard"]
        assert plan["index_kv"]["layout"] == "gfx950_fp4_preshuffled"  # layout tag separate from the quant mode
    else:  # the FP4 logits kernel's tiles are gfx950's; every other index plane is row-major
        assert plan["index_kv"]["layout"] == "row-major"
    if target == "gfx942":
        assert plan["weights"]["expert"] == {"storage": "fp4", "block": (1, 32), "scale": "e8m0", "compute": "fp16"}
    if target != "llvm":
        assert plan["main_kv"]["storage"] == "fp8" and plan["main_kv"]["row_bytes"] == 584


def test_fnuz_re_encoding_on_every_byte():
    codes = np.arange(256, dtype=np.uint8)
    fnuz = lowbit.e4m3fn_to_fnuz(codes)
    fn_values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    fnuz_values = fnuz.view(ml_dtypes.float8_e4m3fnuz).astype(np.float32)
    for c in range(256):
        if np.isnan(fn_values[c]):
            assert np.isnan(fnuz_values[c]), f"NaN code {c:#x} must stay NaN"
        else:
            # Same bits worth half: doubling the scale gives back the same value.
            assert 2 * fnuz_values[c] == fn_values[c], f"code {c:#x}"
    assert fnuz[0x80] == 0x00  # -0 is NaN in fnuz


def test_inspect_plan_and_json_keys(capsys):
    assert cli(["inspect", "flash", "--target", "gfx942", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fp8_format"] == "e4m3fnuz" and report["expert_format"] == "fp4"
    assert report["main_row_bytes"] == 584 and report["index_row_bytes"] == 132
    assert cli(["inspect", "pro", "--target", "gfx950", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "fp4" in out and "Hadamard" in out


def test_norm_rope_fusion_covers_queries_and_kv():
    program = fuse_norm_rope(trace(preset("flash")))
    verify(program)
    counts = program.functions["step"].op_counts()
    layers = preset("flash").num_layers
    # per layer: the query heads and the window KV row; the indexer queries have no norm.
    assert counts["rmsnorm_rope"] == 2 * layers
    assert counts["rope"] == layers + sum(l.has_indexer for l in preset("flash").layers)  # inverse + index q


def test_the_lowering_takes_every_weight_format_from_the_plan():
    """The plan's entry per weight kind is the one answer: a plan that stores the dense kind as
    BF16 gives BF16 kernels and BF16 artifact tensors for every dense weight, FP8 nowhere; the
    compute field says what the kernels multiply (fp32 on the CPU, fp16 tensor-core operands on GPUs)."""
    from dsv4c.codegen.lowering import kernel_table, weight_layouts

    cfg = preset("tiny")
    program = run_pipeline(trace(cfg))
    plan = plan_for(cfg, "llvm")
    assert plan.weight_format("dense").name == "fp8_b128" and plan.weights["dense"].compute == "fp32"
    assert {w.compute for k, w in plan_for(cfg, "sm90").weights.items() if k in ("dense", "expert", "bf16")} == {"fp16"}
    specs, _ = kernel_table(program, plan)
    assert any("fp8_b128" in s for s in specs)
    bf16_dense = replace(plan, weights={**plan.weights, "dense": plan.weights["bf16"]})
    specs, _ = kernel_table(program, bf16_dense)
    assert not any("fp8" in s for s in specs)
    layouts = weight_layouts(program, bf16_dense)
    assert layouts["layers.0.attn.wo_b.weight"].format.name == "bf16"
    assert weight_layouts(program, plan)["layers.0.attn.wo_b.weight"].format.name == "fp8_b128"
