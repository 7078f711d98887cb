"""The bf16 GEMM on AMX tiles (``kernels.bf16.tile_ir``, ``kernels.matmul``'s ``amx``), which no
machine here can run: cross-built for Sapphire Rapids, every weight format's object code holds
the tile instructions; on this machine, the same kernels with a C model of TDPBF16PS (Intel's
pseudocode) in place of the tile function give, bit for bit, a numpy model of the instruction
summed the way the kernel sums, and the AVX512-BF16 kernels give the numpy model of VDPBF16PS;
where every partial sum is exact, both give the exact result.

What this does not show: that a real AMX unit computes what the pseudocode says (the C model is
the pseudocode), and that the tile configuration LLVM writes is right (read in the assembly,
not run)."""

import contextlib
import ctypes
import functools
import json
import shutil
import subprocess
from unittest import mock

import numpy as np
import pytest
import tvm

from dsv4c.artifact import lowbit
from dsv4c.codegen.kernel_factories import KERNELS
from dsv4c.codegen.kernels import bf16, formats, matmul
from dsv4c.targets import host_cpu_flags, target_info

from test_cpu_kernels import _call, _cross_built_asm, _kernel_of, _stored

# (format, out_dim, in_dim, pairs a tdpbf16ps step takes) for every weight format the bf16 GEMM
# reads: FP8 128-blocks (5 k blocks of one group; column strips of 32, two C tiles) and 32-blocks
# (3 k blocks; strips of 16, one tile), FP4 groups (16 a k block), BF16 (8 k blocks of 128 inputs;
# and 3 of 16, 8 pairs a step).
CASES = [("fp8_b128", 192, 640, 16), ("fp8_b32", 48, 96, 16), ("fp4_g32", 16, 512, 16), ("bf16", 64, 1024, 16),
         ("bf16", 32, 48, 8)]
ROWS = 37  # the GEMM's rows (padded to 40: tiles of 16, 16 and 8), or an expert's (16, 16 and 5)
HOST = host_cpu_flags()
needs_avx512_bf16 = pytest.mark.skipif(HOST is None or "avx512_bf16" not in HOST.flags,
                                       reason="runs AVX512-BF16 code (the AMX kernels' vector parts, and vdpbf16ps)")
needs_amx = pytest.mark.skipif(HOST is None or "amx_bf16" not in HOST.flags,
                               reason="runs AMX tiles: needs a CPU with AMX-BF16 (Sapphire Rapids or later), which the "
                                      "build machines lack; scripts/device_check runs it on a host that has one")

# The C model of the tile function (bf16.tile_ir's contract), TDPBF16PS as Intel's pseudocode
# states it: per output, the even and the odd products of the step's pairs summed from zero by
# FMAs, then their sum added to the output; inputs that are subnormal read as zero, subnormal
# results flushed to zero, round to nearest even. rows_seen counts its calls by rows.
TILE_MODEL = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

int rows_seen[17];
int bad_calls;

static float daz(float v) {
  uint32_t u;
  memcpy(&u, &v, 4);
  if (!(u & 0x7f800000u)) u &= 0x80000000u;
  memcpy(&v, &u, 4);
  return v;
}

static float bf16_at(const char* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  uint32_t u = (uint32_t)h << 16;
  float v;
  memcpy(&v, &u, 4);
  return daz(v);
}

static void tdpbf16ps(char* c, int64_t c_stride, const char* a, int64_t a_stride, const char* b, int64_t b_stride,
                      int rows, int k_pairs) {
  for (int m = 0; m < rows; m++)
    for (int n = 0; n < 16; n++) {
      float even = 0, odd = 0, sum;
      for (int k = 0; k < k_pairs; k++) {
        even = daz(fmaf(bf16_at(a + m * a_stride + 4 * k), bf16_at(b + k * b_stride + 4 * n), even));
        odd = daz(fmaf(bf16_at(a + m * a_stride + 4 * k + 2), bf16_at(b + k * b_stride + 4 * n + 2), odd));
      }
      memcpy(&sum, c + m * c_stride + 4 * n, 4);
      sum = daz(daz(sum) + daz(even + odd));
      memcpy(c + m * c_stride + 4 * n, &sum, 4);
    }
}

static void tiles(char* c, char* x, int64_t x_stride, char* b, int64_t b_stride, int16_t rows, int32_t groups,
                  int32_t steps, int col_tiles, int k_pairs, int zero) {
  if (rows < 1 || rows > 16 || groups < 1 || steps < 1) {
    bad_calls++;
    return;
  }
  rows_seen[rows]++;
  int64_t c_stride = 64 * col_tiles;
  for (int g = 0; g < groups; g++) {
    char* cg = c + (int64_t)g * 16 * c_stride;
    if (zero) memset(cg, 0, rows * c_stride);
    for (int i = 0; i < steps; i++) {
      int64_t s = (int64_t)g * steps + i;
      for (int t = 0; t < col_tiles; t++)
        tdpbf16ps(cg + 64 * t, c_stride, x + 4 * k_pairs * s, x_stride, b + k_pairs * s * b_stride + 64 * t,
                  b_stride, rows, k_pairs);
    }
  }
}
"""
MODELLED = [(col_tiles, k_pairs, zero) for col_tiles in (1, 2) for k_pairs in (8, 16) for zero in (False, True)]


@pytest.fixture(scope="module")
def tile_model(tmp_path_factory):
    """The C model built and loaded into this process (RTLD_GLOBAL: the JIT-compiled kernels
    resolve the tile functions against it), under ``tile_function``'s names."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) to build the tile model")
    source = tmp_path_factory.mktemp("amx") / "tile_model.c"
    source.write_text(TILE_MODEL + "".join(
        f"void {bf16.tile_function(*p)}(char* c, char* x, int64_t xs, char* b, int64_t bs, int16_t rows, "
        f"int32_t groups, int32_t steps) {{ tiles(c, x, xs, b, bs, rows, groups, steps, {p[0]}, {p[1]}, "
        f"{int(p[2])}); }}\n"
        for p in MODELLED))
    library = source.with_suffix(".so")
    subprocess.run(["cc", "-O2", "-ffp-contract=off", "-shared", "-fPIC", str(source), "-o", str(library), "-lm"],
                   check=True)
    return ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)


@functools.lru_cache(maxsize=None)
def _built(factory, out_dim, in_dim, quant, amx=False):
    """The bf16 ``linear`` GEMM or ``expert_linear`` kernel (one expert) built for this CPU, or
    (``amx``) for this CPU given AMX-BF16, its tile function left to the C model; "tiles": for
    this CPU, which has AMX, with the tile function's own instructions."""
    target = target_info("llvm").tvm_target()
    if amx != "tiles":  # given AMX, or without it (on a CPU with AMX, the vdpbf16ps kernels)
        sign = "+" if amx else "-"
        target = tvm.target.Target({**target.export(), "mattr": [f"{sign}amx-tile", f"{sign}amx-bf16"]})
    params = (False, 0) if factory == "linear" else (1, False)
    modelled = mock.patch.object(matmul, "tile_ir", lambda *p: "") if amx != "tiles" else contextlib.nullcontext()
    with target, modelled:
        assert bf16.has_amx_bf16() == bool(amx)
        func = KERNELS[factory](out_dim, in_dim, quant, *params, "bf16")
    return _kernel_of(func, target)


def _run(kernel, factory, x, parts, out_dim):
    """y [n, O] of the kernel over x [n, I]: the GEMM's rows padded to blocks of 8, or one
    expert's n rows."""
    n, in_dim = x.shape
    if factory == "expert_linear":
        return _call(kernel, x, np.array([0, n], np.int32), *(p[None] for p in parts), np.zeros((n, out_dim), np.float32))
    blocks = -(-n // 8)
    padded = np.zeros((blocks * 8, in_dim), np.float32)
    padded[:n] = x
    y = np.zeros((blocks, 8, out_dim), np.float32)
    return _call(kernel, padded.reshape(blocks, 8, in_dim), *parts, y).reshape(-1, out_dim)[:n]


def _tile_rows(tile_model, run):
    """run()'s result and the rows of the tile function's calls during it ({rows: calls})."""
    rows_seen = (ctypes.c_int * 17).in_dll(tile_model, "rows_seen")
    ctypes.memset(rows_seen, 0, ctypes.sizeof(rows_seen))
    result = run()
    assert ctypes.c_int.in_dll(tile_model, "bad_calls").value == 0
    return result, {r: rows_seen[r] for r in range(17) if rows_seen[r]}


def _operands(rng, out_dim, in_dim, quant, exact=False):
    """Stored weight parts with power-of-two scales (a scaled group sum times its scale is then
    exact: fused or not, the same bits), x [ROWS, I], and what the kernel multiplies: x rounded
    to BF16, the panel's weights (scaled formats: raw, times 2**X_BOOST) [O, I], the group
    scales [O, I / group] (or None). ``exact``: small integer x and weights, scales 1, so that
    every partial sum is exact."""
    parts, _ = _stored(rng, out_dim, in_dim, quant)
    fmt = formats.tir_format(quant)
    if exact:
        x = rng.integers(-8, 9, (ROWS, in_dim)).astype(np.float32)
    else:
        x = rng.standard_normal((ROWS, in_dim)).astype(np.float32)
    columns = lambda a: np.moveaxis(a, -1, -2).reshape(out_dim, -1)  # noqa: E731  [O / tile, n, tile] -> [O, n]
    if quant == "bf16":
        if exact:
            parts[0] = (rng.integers(-8, 9, parts[0].shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        w = columns(lowbit.f32_from_bf16_bits(parts[0]))
        scales = None
    elif quant == "fp4_g32":
        parts[1][...] = 127 if exact else rng.integers(124, 131, parts[1].shape)
        codes = np.stack([(parts[0] >> (4 * j)) & 15 for j in range(8)], axis=-2).astype(np.uint8)
        codes = codes.reshape(parts[0].shape[:-2] + (in_dim, parts[0].shape[-1]))
        w = columns(lowbit.decode_e2m1(codes)) * np.float32(2.0 ** (formats.X_BOOST - fmt.raw_power))
        scales = columns(np.ldexp(np.float32(1), parts[1].astype(np.int32) - 127)) * \
            np.float32(2.0 ** (fmt.raw_power - formats.X_BOOST))
    else:
        values = lowbit.decode_fp8(parts[0], "e4m3fn")
        if exact:  # integer codes 0..8 and their negatives
            ok = (np.abs(values) <= 8) & (values == np.round(values))
            parts[0][~ok] = 0
            values = lowbit.decode_fp8(parts[0], "e4m3fn")
        parts[1][...] = 1 if exact else np.ldexp(np.float32(1), rng.integers(-3, 4, parts[1].shape))
        w = columns(values) * np.float32(2.0 ** (formats.X_BOOST - fmt.raw_power))
        scales = columns(parts[1]) * np.float32(2.0 ** (fmt.raw_power - formats.X_BOOST))
    xb = lowbit.f32_from_bf16_bits(lowbit.bf16_bits_from_f32(x))
    return parts, x, xb, w.astype(np.float32), None if scales is None else scales.astype(np.float32)


def _model(xb, w, scales, group, instruction, k_pairs=16):
    """What the kernel computes (float32 [ROWS, O]) when its products are summed by
    ``instruction``'s pseudocode: each group's (scaled formats) or the whole row's (unscaled)
    pairs in input order, vdpbf16ps one pair at a time (odd product, then even), tdpbf16ps
    ``k_pairs`` pairs a step (even and odd sums from zero, their sum added); each group's sum times its
    scale added to the total. Products of these values are exact in float32, so an FMA is a
    product and a rounded sum; no value here is subnormal."""
    rows, in_dim = xb.shape
    summed = group if scales is not None else in_dim
    product = lambda k: xb[:, k, None] * w[None, :, k]  # noqa: E731
    total = np.zeros((rows, w.shape[0]), np.float32)
    for first in range(0, in_dim, summed):
        s = np.zeros_like(total)
        if instruction == "vdpbf16ps":
            for k in range(first, first + summed, 2):
                s = (s + product(k + 1)) + product(k)
        else:
            for step in range(first, first + summed, 2 * k_pairs):
                even, odd = np.zeros_like(total), np.zeros_like(total)
                for k in range(step, step + 2 * k_pairs, 2):
                    even, odd = even + product(k), odd + product(k + 1)
                s = s + (even + odd)
        total = total + s * scales[None, :, first // group] if scales is not None else s
    return total


def _group(quant):
    return formats.tir_format(quant).group if quant != "bf16" else None


@needs_avx512_bf16
@pytest.mark.parametrize("quant, out_dim, in_dim, k_pairs", CASES)
def test_amx_kernel_sums_as_tdpbf16ps_and_the_avx512_kernel_as_vdpbf16ps(quant, out_dim, in_dim, k_pairs, tile_model):
    """Random x and weights: the AMX kernel (tiles by the C model) gives the TDPBF16PS model's
    bits, the AVX512-BF16 kernel the VDPBF16PS model's (this CPU's vdpbf16ps follows Intel's
    pseudocode), and the two differ (the orders of their roundings). The tile function ran on
    blocks of 16 rows and one of the 8 left (37 rows padded to 40), nothing else."""
    parts, x, xb, w, scales = _operands(np.random.default_rng(3), out_dim, in_dim, quant)
    amx, seen = _tile_rows(tile_model, lambda: _run(_built("linear", out_dim, in_dim, quant, amx=True), "linear",
                                                    x, parts, out_dim))
    assert set(seen) == {16, 8} and seen[16] == 2 * seen[8]
    np.testing.assert_array_equal(amx, _model(xb, w, scales, _group(quant), "tdpbf16ps", k_pairs))
    avx512 = _run(_built("linear", out_dim, in_dim, quant), "linear", x, parts, out_dim)
    np.testing.assert_array_equal(avx512, _model(xb, w, scales, _group(quant), "vdpbf16ps"))
    assert np.any(amx != avx512)


@needs_avx512_bf16
@pytest.mark.parametrize("quant, out_dim, in_dim, k_pairs", CASES)
def test_amx_and_avx512_kernels_agree_where_every_sum_is_exact(quant, out_dim, in_dim, k_pairs, tile_model):
    """Small integer x and weights, scales 1: every partial sum is exact in fp32, so the AMX
    kernel, the AVX512-BF16 kernel and numpy's float64 products give the same bits. The expert
    kernel's 37 rows: tiles of 16, 16 and the 5 left."""
    parts, x, xb, w, scales = _operands(np.random.default_rng(4), out_dim, in_dim, quant, exact=True)
    want = xb.astype(np.float64) @ w.T.astype(np.float64)
    if scales is not None:
        want = want * scales[0, 0]
    amx, seen = _tile_rows(tile_model, lambda: _run(_built("expert_linear", out_dim, in_dim, quant, amx=True),
                                                    "expert_linear", x, parts, out_dim))
    assert set(seen) == {16, 5} and seen[16] == 2 * seen[5]
    avx512 = _run(_built("expert_linear", out_dim, in_dim, quant), "expert_linear", x, parts, out_dim)
    np.testing.assert_array_equal(amx, want.astype(np.float32))
    np.testing.assert_array_equal(avx512, want.astype(np.float32))
    assert np.abs(want).max() > 0


@needs_amx
@pytest.mark.parametrize("quant, out_dim, in_dim, k_pairs", CASES)
def test_amx_tiles_of_this_cpu_sum_as_tdpbf16ps(quant, out_dim, in_dim, k_pairs, tmp_path):
    """On a CPU with AMX-BF16, the kernels' own tiles: the GEMM gives the TDPBF16PS model's bits
    (what the C model stands in for elsewhere), and where every partial sum is exact, the exact
    result, for the GEMM's 37 rows (tiles of 16, 16, 8) and the expert's (16, 16, 5)."""
    from dsv4c.runtime.backend_tvm import request_tile_data

    request_tile_data(tmp_path)
    parts, x, xb, w, scales = _operands(np.random.default_rng(3), out_dim, in_dim, quant)
    tiles = _run(_built("linear", out_dim, in_dim, quant, amx="tiles"), "linear", x, parts, out_dim)
    np.testing.assert_array_equal(tiles, _model(xb, w, scales, _group(quant), "tdpbf16ps", k_pairs))
    parts, x, xb, w, scales = _operands(np.random.default_rng(4), out_dim, in_dim, quant, exact=True)
    want = xb.astype(np.float64) @ w.T.astype(np.float64) * (1 if scales is None else scales[0, 0])
    expert = _run(_built("expert_linear", out_dim, in_dim, quant, amx="tiles"), "expert_linear", x, parts, out_dim)
    np.testing.assert_array_equal(expert, want.astype(np.float32))


@pytest.mark.parametrize("quant, out_dim, in_dim", [case[:3] for case in CASES[:4]])
def test_amx_kernels_cross_built_for_sapphirerapids(quant, out_dim, in_dim):
    """Built for Sapphire Rapids, every format's GEMM multiplies on tiles: the tile loads,
    tdpbf16ps, the stores of the sums, LLVM's tile configuration and release; no vdpbf16ps.
    Scaled formats start each group's sums from tilezero."""
    asm = _cross_built_asm("sapphirerapids", "linear", out_dim, in_dim, quant, False, 0, "bf16")
    for instruction in ("tdpbf16ps", "tileloadd", "tilestored", "ldtilecfg", "tilerelease"):
        assert instruction in asm
    assert "vdpbf16ps" not in asm
    assert ("tilezero" in asm) == (quant != "bf16")


def test_amx_tile_function_shapes():
    """The tile function's IR: C tiles of 16 fp32 columns (64-byte rows, runtime rows), x tiles
    of k_pairs pairs, panel tiles of k_pairs rows; scaled formats zero each group's sums."""
    ir = bf16.tile_ir(2, 8, True)
    assert "define internal void @dsv4c_tdpbf16ps_2x8_zero(" in ir
    assert ir.count("@llvm.x86.tdpbf16ps.internal(i16 %rows, i16 64, i16 32,") == 2
    assert "@llvm.x86.tileloadd64.internal(i16 %rows, i16 32, ptr %ap, i64 %x_stride)" in ir
    assert ir.count("@llvm.x86.tileloadd64.internal(i16 8, i16 64,") == 2
    assert ir.count("@llvm.x86.tilezero.internal(i16 %rows, i16 64)") == 2
    assert "tilezero.internal(i16 %rows" not in bf16.tile_ir(1, 16, False)


def test_an_amx_artifact_is_refused_here_in_one_line(tiny_llvm, tmp_path, capsys, monkeypatch):
    """A Sapphire Rapids build's manifest lists amx_tile and amx_bf16 (``targets.cpu_features``;
    here the tiny artifact's manifest given that list: a real cross-build takes 1.5 minutes on
    this machine). A CPU without them refuses it in one line; one whose flags list them has
    Linux asked for the tile state first (``request_tile_data``), and a refusal is one line too
    (this machine's Linux refuses: its CPU has no AMX). inspect says the GEMMs run on tiles."""
    from dsv4c import targets
    from dsv4c.cli import main as cli

    if HOST is None or "amx_tile" in HOST.flags:
        pytest.skip("needs /proc/cpuinfo flags without AMX (on an AMX CPU the artifact would load)")
    features = targets.cpu_features(tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids",
                                                       "mtriple": "x86_64-linux-gnu"}))
    assert {"amx_tile", "amx_bf16", "avx512_bf16"} <= set(features)
    art = tmp_path / "spr"
    shutil.copytree(tiny_llvm, art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["kernels"].update(mcpu="sapphirerapids", cpu_features=features)
    manifest["numerics"] = "bf16"
    (art / "manifest.json").write_text(json.dumps(manifest))
    run = ["generate", str(art), "--token-ids", "1,2", "--max-new-tokens", "2"]

    def one_line_error():
        err = capsys.readouterr().err.strip()
        assert err.startswith("dsv4c: error: ") and "\n" not in err and "Traceback" not in err
        return err

    assert cli(run) == 2
    err = one_line_error()
    assert "compiled for CPU sapphirerapids, which needs" in err and "amx_bf16" in err and "lacks" in err
    monkeypatch.setattr(targets, "host_cpu_flags", lambda: targets.HostCpu("Test CPU", HOST.flags | set(features)))
    assert cli(run) == 2
    assert "its kernels use AMX tiles, and Linux refused this process their state (arch_prctl" in one_line_error()
    assert cli(["inspect", str(art)]) == 0
    assert "prefill GEMMs in bf16 by AMX tiles, tdpbf16ps (AMX-BF16 on sapphirerapids)" in capsys.readouterr().out


def test_linux_grants_the_tile_state_where_the_cpu_has_amx(tmp_path):
    """``request_tile_data`` (what loading an AMX artifact does first): granted on a CPU whose
    flags list amx_tile (Linux 5.16 or later), refused in one line elsewhere, as here."""
    from dsv4c.errors import ArtifactError
    from dsv4c.runtime.backend_tvm import request_tile_data

    if HOST is None:
        pytest.skip("no /proc/cpuinfo flags: not Linux on x86, where nothing asks")
    if "amx_tile" in HOST.flags:
        request_tile_data(tmp_path)
        return
    with pytest.raises(ArtifactError, match=r"Linux refused this process their state \(arch_prctl") as refused:
        request_tile_data(tmp_path)
    assert "\n" not in str(refused.value)
