"""Decode's GEMVs for GPU targets (``kernels.gpu_gemv``) built for the CPU with their phases run
one after another, as their barriers order them on the GPU: every weight format against numpy,
dense and grouped projections, expert groups of every size; and the GPU targets pick them for
decode only."""

import numpy as np
import pytest

from dsv4c.codegen.gpu import gpu_kernel
from dsv4c.codegen.kernels import gpu_gemv
from dsv4c.codegen.ops.base import kernel
from dsv4c.targets import target_info
from test_cpu_kernels import _call, _close, _kernel_of, _stored

FORMATS = [("fp4_g32", 128, 256), ("fp8_b128", 80, 384), ("fp8_b32", 80, 112), ("bf16", 64, 96), ("fp32", 72, 40)]


@pytest.mark.parametrize("quant, out_dim, in_dim", FORMATS)
@pytest.mark.parametrize("rows, groups", [(1, 0), (6, 0), (3, 2)])
def test_linear_gemv_matches_numpy(quant, out_dim, in_dim, rows, groups):
    """One token; more rows than a pass of four; a grouped projection (x [N, G, I]). Column tiles
    of 64, 16 and 8; inputs that split unevenly into the four quarters (40: 10 each)."""
    rng = np.random.default_rng(out_dim + rows)
    lead = (groups,) if groups else ()
    parts, w = _stored(rng, out_dim, in_dim, quant, lead)
    x = rng.standard_normal((rows,) + lead + (in_dim,)).astype(np.float32)
    kernel_ = _kernel_of(gpu_gemv.linear_gemv(out_dim, in_dim, quant, groups, emulate=True))
    y = _call(kernel_, x, *parts, np.full((rows,) + lead + (out_dim,), np.nan, np.float32))
    want = np.einsum("n...i,...oi->n...o", x.astype(np.float64), w)
    _close(y, want)


@pytest.mark.parametrize("quant, out_dim, in_dim", FORMATS)
def test_expert_gemv_matches_numpy_for_groups_of_every_size(quant, out_dim, in_dim):
    """Experts with 0 rows (nothing read), 1, 4 (one pass), 5 and 9 (passes of 4, the last part
    full)."""
    rng = np.random.default_rng(out_dim)
    sizes = [5, 0, 1, 9, 4, 0]
    parts, w = _stored(rng, out_dim, in_dim, quant, (len(sizes),))
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    x = rng.standard_normal((offsets[-1], in_dim)).astype(np.float32)
    kernel_ = _kernel_of(gpu_gemv.expert_gemv(out_dim, in_dim, quant, len(sizes), emulate=True))
    y = _call(kernel_, x, offsets, *parts, np.full((offsets[-1], out_dim), np.nan, np.float32))
    for e in np.flatnonzero(sizes):
        rows = slice(offsets[e], offsets[e + 1])
        _close(y[rows], x[rows].astype(np.float64) @ w[e].T)


@pytest.mark.parametrize("target", ["sm90", "gfx950"])
def test_gpu_targets_run_decode_on_the_gemvs_and_prefill_on_tensor_cores(target):
    tvm_target = target_info(target).tvm_target()
    build = lambda *params: gpu_kernel(kernel(*params), tvm_target).script()  # noqa: E731
    assert build("expert_linear", 2048, 4096, "fp4_g32", 256, True) == \
        gpu_gemv.expert_gemv(2048, 4096, "fp4_g32", 256).script()
    assert build("linear", 1024, 4096, "fp8_b128", True, 8) == gpu_gemv.linear_gemv(1024, 4096, "fp8_b128", 8).script()
    for prefill in (build("expert_linear", 2048, 4096, "fp4_g32", 256), build("linear", 1024, 4096, "fp8_b128", False, 8)):
        assert "mma" in prefill or "mfma" in prefill
