"""The GPU's parallel expert grouping (``kernels.gpu_moe``) built for the CPU with its phases run
one after another, as its barriers order them on the GPU: the serial ``moe_group``'s outputs bit
for bit (pairs grouped by expert, in token order)."""

import numpy as np
import pytest
import tvm

from dsv4c.codegen import step_kernels
from dsv4c.codegen.gpu import gpu_kernel
from dsv4c.codegen.kernels import gpu_moe
from dsv4c.codegen.ops.base import kernel
from test_cpu_kernels import _kernel_of


def _grouped(func, ids, n_experts):
    n, k = ids.shape
    outs = [np.full(n_experts + 1, -1, np.int32), np.full(n * k, -1, np.int32), np.full((n, k), -1, np.int32)]
    tensors = [tvm.runtime.tensor(a) for a in [ids] + outs]
    _kernel_of(func)(*tensors)
    return [t.numpy() for t in tensors[1:]]


@pytest.mark.parametrize("n, k, n_experts, skew, foreign", [
    (1, 2, 8, False, False), (5, 3, 3, False, False), (37, 6, 256, False, False), (700, 8, 384, False, False),
    (300, 6, 256, True, False), (9, 2, 1, False, False), (37, 6, 8, False, True), (700, 8, 128, False, True)])
def test_parallel_grouping_is_the_serial_one(n, k, n_experts, skew, foreign):
    """One token; fewer pairs than threads; uneven chunks (700 x 8 pairs on 256 threads); an odd
    bit count padded to an even pass count (3 experts: 2 bits; 384: 9 bits, 10 passes); most
    pairs on one expert; one expert (no id bits); half the pairs on experts another rank holds
    (-1, tensor parallel)."""
    rng = np.random.default_rng(n)
    ids = rng.integers(0, n_experts, (n, k)).astype(np.int32)
    if skew:
        ids[rng.random((n, k)) < 0.8] = n_experts - 1
    if foreign:
        ids[rng.random((n, k)) < 0.5] = -1
    serial = _grouped(step_kernels.moe_group(k, n_experts), ids, n_experts)
    parallel = _grouped(gpu_moe.moe_group_parallel(k, n_experts, emulate=True), ids, n_experts)
    for got, want in zip(parallel, serial):
        assert np.array_equal(got, want)


def test_gpu_targets_build_the_parallel_grouping():
    """sm90's moe_group is the parallel one: a block of THREADS threads with barriers between its phases."""
    func = gpu_kernel(kernel("moe_group", 6, 256), tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}))
    source = tvm.compile(tvm.IRModule({"main": func}), target={"kind": "cuda", "arch": "sm_90a"}).mod.imports[0]
    cuda = source.inspect_source("cuda")
    assert f"__launch_bounds__({gpu_moe.THREADS})" in cuda and cuda.count("__syncthreads()") >= 4
