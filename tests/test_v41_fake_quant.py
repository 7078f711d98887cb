"""V4.1's activation round trips (docs/v41.md, "Fake-quant"): the grids' ties, the scale rules and
the vectors they leave alone; the parity tests check them end to end against the reference."""

import numpy as np
import pytest

from dsv4c.artifact.lowbit import v41_roundtrip


def test_fp4_ties_go_to_the_even_code():
    # With a block amax of 6 the power-of-two scale is 1: values are e2m1 codes themselves.
    x = np.array([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25] + [0] * 23, np.float32)
    got = v41_roundtrip(x, "fp4_b32")
    assert got[:9].tolist() == [6, 0, 1, 1, 2, 2, 4, 4, -0.0]


def test_the_scales():
    x = np.zeros(32, np.float32)
    x[0], x[1] = 7.0, 1.0  # amax 7: the power-of-two scale 2 (7 / 6 rounded up), 1 / 2 = 0.5 on the grid
    assert v41_roundtrip(x, "fp4_b32")[:2].tolist() == [8.0, 1.0]
    y = np.zeros(16, np.float32)
    y[0], y[1] = 7.0, 1.0  # compressed rows: an e4m3 scale 7 / 6 (1.1666 -> 1.125), then 7 / 1.125 -> 6
    assert v41_roundtrip(y, "fp4_e4m3_b16")[:2] == pytest.approx([6.75, 1.125])
    z = np.zeros(32, np.float32)
    z[0], z[1] = 448.0, 1.0 / 3  # FP8: scale 1; e4m3 steps by 1/32 in [1/4, 1/2): 1/3 -> 11/32
    assert v41_roundtrip(z, "fp8_b32")[:2].tolist() == [448.0, 0.34375]


@pytest.mark.parametrize("fmt, width", [("fp8_b32", 48), ("fp4_b32", 16), ("fp4_e4m3_b16", 24)])
def test_a_vector_not_of_whole_blocks_passes_unchanged(fmt, width):
    x = np.random.default_rng(0).standard_normal((3, width)).astype(np.float32)
    assert np.array_equal(v41_roundtrip(x, fmt), x)
