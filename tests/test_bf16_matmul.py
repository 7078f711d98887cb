"""The bf16 numerics' GEMMs (``kernels.matmul`` with compute "bf16", ``kernels.bf16``) against
numpy: activations rounded to BF16 (nearest-even), the FP8 / FP4 / BF16 weights exactly, summed
in fp32; on this host (vdpbf16ps where it has AVX512-BF16) and as x86-64-v3 code (fp32 FMAs on
the rounded activations), with the instructions checked in cross-built assembly; the plan and
the lowering that choose them; and the whole tiny model held to the budget docs/numerics.md
states."""

import numpy as np
import pytest

from dsv4c.artifact import lowbit
from dsv4c.cli import main as cli
from dsv4c.codegen.kernels.bf16 import bf16_matmuls

from test_cpu_kernels import _call, _cross_built_asm, _kernel, _stored

BF16_QUANTS = ("fp8_b128", "fp8_b32", "fp4_g32", "bf16")  # every weight format the plan multiplies in bf16
CPUS = [None, "x86-64-v3"]
U = 2.0 ** -24  # float32's unit roundoff


def _bf16(x):
    return lowbit.f32_from_bf16_bits(lowbit.bf16_bits_from_f32(x)).astype(np.float64)


def _bf16_gemm(out_dim, in_dim, quant, x, parts, groups=0, cpu=None):
    """The bf16 GEMM over x [n, (G,) I] padded to blocks of 8 rows (as matmul_test's _gemm)."""
    n, lead = x.shape[0], x.shape[1:-1]
    blocks = -(-n // 8)
    padded = np.zeros(lead + (blocks * 8, in_dim), np.float32)
    padded[..., :n, :] = np.moveaxis(x, 0, -2)
    y = np.zeros((blocks, 8) + lead + (out_dim,), np.float32)
    kernel = _kernel("linear", out_dim, in_dim, quant, False, groups, "bf16", cpu=cpu)
    return _call(kernel, padded.reshape(lead + (blocks, 8, in_dim)), *parts, y).reshape((-1,) + lead + (out_dim,))[:n]


def _check(got, x, w_t, in_dim):
    """got within the fp32 summation bound of the products of x rounded to BF16 and the exact
    weights: each product is exact in fp32 (8 x 8 significant bits), and any order of summing
    in_dim of them in fp32 (vdpbf16ps pairs, scale groups, then totals) errs by at most
    in_dim * u * the sum of their magnitudes. The same bound fails against unrounded x: the
    rounding happened."""
    xr = _bf16(x)
    magnitude = np.abs(xr) @ np.abs(w_t)
    assert np.all(np.abs(got - xr @ w_t) <= in_dim * U * magnitude)
    assert np.any(np.abs(got - x.astype(np.float64) @ w_t) > in_dim * U * magnitude)


@pytest.mark.parametrize("quant, out_dim, in_dim, cpu", [
    ("fp8_b128", 192, 4 * 128 + 128, None), ("fp8_b128", 80, 96, "x86-64-v3"), ("fp8_b32", 64, 96, None),
    ("fp8_b32", 24, 160, None), ("fp4_g32", 128, 1024, None), ("fp4_g32", 40, 64, "x86-64-v3"),
    ("bf16", 192, 576, None), ("bf16", 12, 64, None), ("bf16", 48, 96, "x86-64-v3")])
def test_bf16_gemm_matches_numpy(quant, out_dim, in_dim, cpu):
    """Column tiles of 64, 16 and 8 (narrower than a vdpbf16ps: the FMA micro-kernel), k blocks
    that are not whole scale groups (96 of FP8's 128-blocks), several k blocks (1024), and 37
    rows: whole register blocks, a half block and single rows; x86-64-v3 code (the FMA
    fallback) on one of each format."""
    rng = np.random.default_rng(out_dim + in_dim)
    parts, w = _stored(rng, out_dim, in_dim, quant)
    x = rng.standard_normal((37, in_dim)).astype(np.float32)
    _check(_bf16_gemm(out_dim, in_dim, quant, x, parts, cpu=cpu), x, w.T, in_dim)


def test_bf16_grouped_gemm_and_chunks_of_rows():
    """Grouped projections (group-major x), and 300 rows: more than one chunk of rows (256)."""
    rng = np.random.default_rng(5)
    groups, out_dim, in_dim = 3, 64, 256
    parts, w = _stored(rng, out_dim, in_dim, "fp8_b128", (groups,))
    x = rng.standard_normal((300, groups, in_dim)).astype(np.float32)
    got = _bf16_gemm(out_dim, in_dim, "fp8_b128", x, parts, groups)
    for g in range(groups):
        _check(got[:, g], x[:, g], w[g].T, in_dim)


def test_bf16_expert_linear():
    """Experts of more than GEMV_ROWS rows take the bf16 panel loop; those of at most 4 rows the
    direct loop, which stays exact (fp32 x: within the exact kernels' 1e-5 of numpy's unrounded
    products, which rounding x to BF16 is not)."""
    rng = np.random.default_rng(9)
    experts, out_dim, in_dim = 4, 64, 128
    parts, w = _stored(rng, out_dim, in_dim, "fp4_g32", (experts,))
    sizes = [13, 0, 4, 30]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    x = rng.standard_normal((offsets[-1], in_dim)).astype(np.float32)
    y = _call(_kernel("expert_linear", out_dim, in_dim, "fp4_g32", experts, False, "bf16"),
              x, offsets, *parts, np.zeros((offsets[-1], out_dim), np.float32))
    for e in (0, 3):
        rows = slice(offsets[e], offsets[e + 1])
        _check(y[rows], x[rows], w[e].T, in_dim)
    rows = slice(offsets[2], offsets[3])
    want = x[rows].astype(np.float64) @ w[2].T
    assert np.abs(y[rows] - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("mcpu, quant, dot", [("znver4", "fp8_b128", True), ("cooperlake", "fp4_g32", True),
                                             ("x86-64-v3", "fp8_b128", False)])
def test_bf16_gemm_instructions(mcpu, quant, dot):
    """Built for a CPU with AVX512-BF16 and no AMX (Zen 4 / Zen 5, Cooper Lake), the GEMM's
    products are vdpbf16ps; for x86-64-v3 (no AVX-512) fp32 FMAs on the rounded x, and no
    vdpbf16ps; inspect says which (AMX builds: test_amx_matmul)."""
    asm = _cross_built_asm(mcpu, "linear", 128, 128, quant, False, 0, "bf16")
    assert ("vdpbf16ps" in asm) == dot
    assert "tdpbf16ps" not in asm
    assert any("vfmadd" in line for line in asm.splitlines())  # the totals (and the fallback's products)
    assert ("by vdpbf16ps" in bf16_matmuls(mcpu, dot)) == dot


def test_plan_and_lowering_choose_bf16_for_the_prefill_gemms_only():
    """bf16 numerics: the FP8 / FP4 / BF16 weights' GEMMs (and the experts' prefill kernels)
    take compute bf16; the GEMVs, the fp32 router gate and every kernel of exact keep the
    exact kernels (the same symbols); a target without the CPU GEMMs refuses it."""
    from dsv4c.codegen.lowering import kernel_table
    from dsv4c.errors import UsageError
    from dsv4c.frontend.config import preset
    from dsv4c.frontend.trace import trace
    from dsv4c.passes.pipeline import run_pipeline
    from dsv4c.passes.quant_plan import plan_for

    cfg = preset("tiny")
    program = run_pipeline(trace(cfg, "bf16"))
    assert program.numerics == "exact"
    exact, _ = kernel_table(program, plan_for(cfg, "llvm", "exact"))
    bf16, _ = kernel_table(program, plan_for(cfg, "llvm", "bf16"))
    matmuls = ("linear", "expert_linear")
    widened = {s for s, spec in bf16.items() if spec.factory in matmuls and spec.params.compute == "bf16"}
    assert widened and all(not spec.params.gemv if spec.factory == "linear" else not spec.params.decode
                           for spec in (bf16[s] for s in widened))
    assert set(bf16) - widened <= set(exact)
    assert all(spec.params.compute == "fp32" for spec in exact.values() if spec.factory in matmuls)
    assert any(spec.factory == "linear" and spec.params.quant == "fp32" and not spec.params.gemv
               for spec in bf16.values())  # the router gate's GEMM stays fp32
    with pytest.raises(UsageError, match="bf16 numerics"):
        plan_for(cfg, "reference", "bf16")


# The budget docs/numerics.md states for the tiny model (random weights): the bf16 artifact's
# prefill logits against the exact artifact's, over 2 prompts of 96 positions.
TINY_TOP1 = 0.9
TINY_MEAN_KL = 5e-3


def test_tiny_bf16_artifact_within_the_budget(tiny_llvm, tmp_path, capsys):
    """The tiny model compiled with --numerics bf16 (the manifest says so) prefills within the
    documented budget of the exact artifact (the session's), and not bit for bit."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from numerics_budget import all_logits, budget

    from dsv4c.artifact.manifest import read_manifest

    art = tmp_path / "bf16"
    assert cli(["compile", "--model", str(tiny_llvm.parent / "model"), "--target", "llvm", "--numerics", "bf16",
                "-o", str(art)]) == 0
    manifest = read_manifest(art)
    assert manifest.numerics == "bf16" and manifest.quant_plan["weights"]["dense"]["compute"] == "bf16"
    prompts = np.random.default_rng(1).integers(0, manifest.model["vocab_size"], (2, 96))
    r = budget(all_logits(tiny_llvm, prompts, 48), all_logits(art, prompts, 48))
    assert r["top1_agreement"] >= TINY_TOP1 and r["mean_kl"] <= TINY_MEAN_KL
    assert r["max_abs_delta_logit"] > 0
    capsys.readouterr()
    assert cli(["inspect", str(art)]) == 0
    assert "prefill GEMMs in bf16 by" in capsys.readouterr().out
