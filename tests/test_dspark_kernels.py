"""The kernels DSpark's drafter adds to the compiled targets, against numpy models: the draft
block's attention rows (``step_kernels.block_attention_rows``), the mean over the hc streams and
the column concatenation (GPU builds of them: tests/test_dspark_compiled.py)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import tvm

from dsv4c.codegen.kernel_factories import KERNELS
from dsv4c.targets import target_info


@functools.lru_cache(maxsize=None)
def _kernel(factory: str, *params):
    func = KERNELS[factory](*params)
    return tvm.compile(tvm.IRModule({"k": func.with_attr("global_symbol", "k")}),
                       target=target_info("llvm").tvm_target())["k"]


def _call(kernel, inputs: list, out_shape, dtype, scalars=()):
    tensors = [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in inputs]
    out = tvm.runtime.tensor(np.zeros(out_shape, dtype))
    kernel(*tensors, *scalars, out)
    return out.numpy()


def _block_rows_model(req: np.ndarray, n: int, window: int, per_request: int, layer: int, pool_rows: int):
    """Per token: its request's ring rows of the ``window`` positions before the request's first
    position (-1 before position 0), then the request's tokens of the call as fresh rows."""
    rows = np.full((n, window + n), -1, np.int64)
    for slot, first, count, p0 in req:
        ring = [-1 if p < 0 else pool_rows - (slot + 1) * per_request + layer * window + p % window
                for p in range(p0 - window, p0)]
        fresh = [pool_rows + first + j for j in range(count)]
        rows[first:first + count, :window + count] = ring + fresh
    return rows


@pytest.mark.parametrize("block", [1, 2, 5])
def test_block_attention_rows_match_the_row_table(block):
    window, layers, pool_rows = 8, 3, 1000
    per_request = layers * window
    rng = np.random.default_rng(block)
    # Requests at positions before, at and past one window, in slots out of order.
    firsts = [0, 3, window, window + 5, 3 * window + 7]
    slots = rng.permutation(len(firsts))
    req = np.array([(slots[i], i * block, block, p0) for i, p0 in enumerate(firsts)], np.int32)
    n = len(firsts) * block
    tok_req = np.repeat(np.arange(len(firsts)), block).astype(np.int32)
    for layer in range(layers):
        got = _call(_kernel("block_attention_rows", window, per_request), [tok_req, req], (n, window + n), np.int32,
                    scalars=(layer, pool_rows))
        np.testing.assert_array_equal(got, _block_rows_model(req, n, window, per_request, layer, pool_rows))


def test_hc_mean_and_concat_columns():
    rng = np.random.default_rng(0)
    h = rng.standard_normal((5, 4, 24)).astype(np.float32)
    got = _call(_kernel("hc_mean", 4, 24), [h], (5, 24), np.float32)
    np.testing.assert_allclose(got, h.mean(axis=1), rtol=1e-6, atol=1e-6)
    a, b = rng.standard_normal((5, 24)).astype(np.float32), rng.standard_normal((5, 7)).astype(np.float32)
    got = _call(_kernel("concat_columns", 24, 7), [a, b], (5, 31), np.float32)
    np.testing.assert_array_equal(got, np.concatenate([a, b], axis=1))
