"""The tensor-core GEMMs of ``kernels.gpu_matmul`` built for the CPU with the tensor-core
instruction emulated on its fragment layout (sm90's and the MFMA's): tiling, masking of rows
past the matrix or an expert's group, weight decoding and row mapping against numpy on
float16-rounded operands, and the documented error against the exact product."""

import re

import numpy as np
import pytest
import tvm

from dsv4c.codegen.kernels import gpu_matmul as gm
from test_cpu_kernels import _call, _kernel_of, _stored

LAYOUTS = {"sm90": gm.CUDA_LAYOUT, "rocm": gm.ROCM_LAYOUT}
QUANTS = ("fp32", "fp8_b128", "fp8fnuz_b128", "fp8_b32", "fp4_g32", "bf16")  # fp8_b32: V4.1's 32 x 32 blocks


def _f16(a):
    return a.astype(np.float16).astype(np.float64)


def _check(got, x, w):
    """float32 sums of float16 operands: within float32 rounding of numpy's on the same operands,
    and within the module docstring's bound of the exact product."""
    rounded, exact = _f16(x) @ _f16(w).T, x.astype(np.float64) @ w.T
    scale = np.abs(exact).max()
    assert np.abs(got - rounded).max() <= 1e-5 * scale
    terms = np.sqrt((x.astype(np.float64) ** 2) @ (w ** 2).T)  # rms of the terms times sqrt(n)
    assert np.all(np.abs(got - exact) <= 4 * 2.0 ** -11 * terms + 1e-6 * scale)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("groups", [0, 2])
def test_prefill_gemm_matches_numpy(layout, quant, groups):
    """72 rows (two row tiles, the second partial), 128 columns (two column tiles), 256 inputs
    (FP8's two blocks, FP4's eight groups); grouped: x group-major as prefill's pad_rows lays it."""
    rng = np.random.default_rng(7)
    out_dim, in_dim, blocks = 128, 256, 9
    lead = (groups,) if groups else ()
    parts, w = _stored(rng, out_dim, in_dim, quant, lead)
    x = rng.standard_normal(lead + (blocks, 8, in_dim)).astype(np.float32)
    y = np.full((blocks, 8) + lead + (out_dim,), np.nan, np.float32)
    kernel = _kernel_of(gm.mma_linear(out_dim, in_dim, quant, groups, LAYOUTS[layout], emulate=True))
    got = _call(kernel, x, *parts, y)
    for g in range(max(groups, 1)):
        rows = (x[g] if groups else x).reshape(-1, in_dim)
        _check(got[:, :, g].reshape(-1, out_dim) if groups else got.reshape(-1, out_dim), rows,
               w[g] if groups else w)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("quant", ["fp8_b128", "fp4_g32", "bf16"])
def test_expert_gemm_matches_numpy(layout, quant):
    """Experts with 5, 0, 1, 13, 70 (two row tiles) and 0 rows: every row written once, by its
    expert, from its expert's weights."""
    rng = np.random.default_rng(9)
    experts, out_dim, in_dim = 6, 64, 64
    parts, w = _stored(rng, out_dim, in_dim, quant, (experts,))
    sizes = [5, 0, 1, 13, 70, 0]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    x = rng.standard_normal((offsets[-1], in_dim)).astype(np.float32)
    y = np.full((offsets[-1], out_dim), np.nan, np.float32)
    kernel = _kernel_of(gm.mma_expert_linear(out_dim, in_dim, quant, experts, LAYOUTS[layout], emulate=True))
    got = _call(kernel, x, offsets, *parts, y)
    for e in np.flatnonzero(sizes):
        rows = slice(offsets[e], offsets[e + 1])
        _check(got[rows], x[rows], w[e])


def test_layouts_place_every_element_once():
    """Each layout maps its lanes x slots one to one onto a 16 x 16 fragment, for x, weights and sums."""
    for layout in LAYOUTS.values():
        assert layout.lanes * layout.slots == gm.FRAGMENT * gm.FRAGMENT
        for place in (layout.x, layout.w, layout.sums):
            cells = {place(lane, slot) for lane in range(layout.lanes) for slot in range(layout.slots)}
            assert cells == {(r, c) for r in range(gm.FRAGMENT) for c in range(gm.FRAGMENT)}


def test_only_tiling_matmuls_take_tensor_cores():
    from dsv4c.codegen.ops.base import kernel

    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    assert gm.mma_kernel(kernel("linear", 256, 64, "fp8_b128", False, 0), cuda) is not None
    assert gm.mma_kernel(kernel("expert_linear", 128, 256, "fp4_g32", 8), cuda) is not None
    assert gm.mma_kernel(kernel("linear", 256, 64, "fp8_b128", True, 0), cuda) is None  # decode's GEMV
    assert gm.mma_kernel(kernel("linear", 160, 64, "bf16", False, 0), cuda) is None  # 160: not whole blocks
    with pytest.raises(gm.MmaTargetError, match="no tensor-core GEMM for target kind 'llvm'"):
        gm.target_layout(tvm.target.Target({"kind": "llvm"}))


NARROW_RIGHT_SHIFT = re.compile(r">>\s*\(\s*(short|ushort|char|uchar|signed char)\s*\)")


@pytest.mark.parametrize("quant", ["fp4_g32", "fp8_b128", "bf16"])
def test_cuda_source_shifts_no_16_bit_value_right(quant):
    """CUDA C promotes a 16- or 8-bit operand to int before a shift, so a right shift that TIR
    means on an int16 (sign spreading from bit 15) shifts a positive int there: the FP4 decode
    that did so read negative codes as positive on an H200 (scripts/device_check). The sm90
    source of every weight-decoding GPU kernel has no such shift."""
    from dsv4c.codegen.kernels import gpu_gemv
    from dsv4c.targets import target_info

    target = target_info("sm90").tvm_target()
    for func in (gm.mma_expert_linear(128, 256, quant, 4, gm.CUDA_LAYOUT), gm.mma_linear(128, 256, quant, 0, gm.CUDA_LAYOUT),
                 gpu_gemv.expert_gemv(128, 256, quant, 4), gpu_gemv.linear_gemv(128, 256, quant)):
        source = tvm.tirx.build(tvm.IRModule({"main": func}), target=target).imports[0].inspect_source()
        assert "__global__" in source and not NARROW_RIGHT_SHIFT.search(source)
