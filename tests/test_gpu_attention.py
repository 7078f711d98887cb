"""The GPU's blocked sparse attention (``kernels.gpu_attention``) built for the CPU with its phases
run one after another, as its barriers order them on the GPU: the CPU kernel's outputs within
rounding (its sums run in another order). On fp8 pool rows: tests/test_pool_kernels.py."""

import numpy as np
import pytest

from dsv4c.codegen.gpu import gpu_kernel
from dsv4c.codegen.kernels import gpu_attention
from dsv4c.codegen.ops.base import kernel
from dsv4c.frontend.config import resolve_model
from dsv4c.targets import target_info
from test_cpu_kernels import _call, _kernel, _kernel_of

F32 = np.float32


def _blocked(*params):
    return _kernel_of(gpu_attention.sparse_attn_blocked(*params, emulate=True))


@pytest.mark.parametrize("heads, dim", [(4, 64), (64, 512), (6, 128), (2, 32), (16, 48)])
def test_blocked_attention_is_the_cpu_kernels_within_rounding(heads, dim):
    """Tiny's and Flash's shapes; head counts under a group or not a power of two (6: groups of
    2); a head dim with few factors of two (48: 16 threads, several (head, row) pairs each).
    Rows: pool rows, this step's fresh rows, -1 gaps, a whole block without rows, a query
    without any row (its output 0: the sink alone), a list not a multiple of the row block."""
    rng = np.random.default_rng(heads * dim)
    n, m, pool_rows, step_rows = 4, 21, 40, 5
    q = rng.standard_normal((n, heads, dim)).astype(F32)
    pool = rng.standard_normal((pool_rows, dim)).astype(F32)
    step = rng.standard_normal((step_rows, dim)).astype(F32)
    sink = rng.standard_normal(heads).astype(F32)
    rows = rng.integers(0, pool_rows + step_rows, (n, m)).astype(np.int32)
    rows[0, 8:16] = -1
    rows[1, ::3] = -1
    rows[2, :] = -1
    out = np.zeros((n, heads, dim), F32)
    want = _call(_kernel("sparse_attn", heads, dim, dim ** -0.5), q, pool, step, sink, rows, out.copy())
    got = _call(_blocked(heads, dim, dim ** -0.5), q, pool, step, sink, rows, out.copy())
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not got[2].any()


def test_gpu_targets_build_the_blocked_kernel_for_both_head_blocks():
    """Decode's and prefill's sparse_attn specs (their CPU head blocks differ) give GPU targets one
    and the same blocked kernel."""
    cfg = resolve_model("flash")
    target = target_info("sm90").tvm_target()
    decode = gpu_kernel(kernel("sparse_attn", cfg.num_heads, cfg.head_dim, 0.04, "fp8", cfg.rope_dim, "e4m3fn"),
                        target)
    prefill = gpu_kernel(kernel("sparse_attn", cfg.num_heads, cfg.head_dim, 0.04, "fp8", cfg.rope_dim, "e4m3fn",
                                64), target)
    blocked = gpu_attention.sparse_attn_blocked(cfg.num_heads, cfg.head_dim, 0.04, "fp8", cfg.rope_dim, "e4m3fn")
    assert decode.script() == prefill.script() == blocked.script()
    assert "threadIdx.x" in decode.script() and "shared" in decode.script()
