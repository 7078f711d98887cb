"""Low-bit formats against ml_dtypes, plus hand-computed quantization examples."""

import ml_dtypes
import numpy as np
import pytest

from dsv4c.artifact.lowbit import (
    decode_e2m1,
    decode_e4m3fn,
    decode_e4m3fnuz,
    decode_e8m0,
    decode_fp8,
    dequantize_fp4_groups,
    dequantize_fp8_blocks,
    encode_e2m1,
    encode_e4m3fn,
    encode_e8m0,
    fp4_roundtrip,
    fp8_in_format,
    fp8_roundtrip,
    hadamard,
    pack_fp4,
    pow2_ceil_scale,
    quantize_fp4_groups,
    quantize_fp8_blocks,
    unpack_fp4,
)
from dsv4c.artifact.quant import FP8_BLOCK_SIZES, WEIGHT_FORMATS, fp8_format_name
from dsv4c.artifact.rows import Rows

RNG = np.random.default_rng(0)


def _oracle_codes(x: np.ndarray, dtype) -> np.ndarray:
    return x.astype(np.float32).astype(dtype).view(np.uint8)


def _grid_sweep(grid: np.ndarray) -> np.ndarray:
    """Grid points, their midpoints (ties) and the float32 neighbours of each, both signs."""
    grid = np.unique(grid)
    midpoints = (grid[:-1] + grid[1:]) / 2  # exact: one extra bit
    points = np.concatenate([grid, midpoints])
    points = np.concatenate([points, np.nextafter(points, np.float32(-np.inf)),
                             np.nextafter(points, np.float32(np.inf))])
    points = points[points >= 0]
    return np.concatenate([points, -points]).astype(np.float32)


E4M3_FINITE = decode_e4m3fn(np.arange(0x7F, dtype=np.uint8))  # +0 .. 448


def test_e4m3fn_decodes_all_256_codes_like_ml_dtypes():
    codes = np.arange(256, dtype=np.uint8)
    expected = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    actual = decode_e4m3fn(codes)
    assert actual.dtype == np.float32
    np.testing.assert_array_equal(actual, expected)
    finite = np.isfinite(expected)  # the sign of NaN carries no meaning
    assert np.array_equal(np.signbit(actual[finite]), np.signbit(expected[finite]))  # -0.0 is 0x80


def test_e4m3fn_encode_matches_ml_dtypes_in_range():
    subnormal_sweep = np.linspace(0, 2.0**-6, 20001, dtype=np.float32)  # quantum 2**-9
    log_uniform = np.exp2(RNG.uniform(-14, np.log2(448), 100_000)).astype(np.float32)
    x = np.concatenate([_grid_sweep(E4M3_FINITE), subnormal_sweep, -subnormal_sweep,
                        log_uniform, -log_uniform, RNG.standard_normal(100_000).astype(np.float32) * 50,
                        np.float32([2.0**-149, 1e-40, -1e-40])])  # float32 subnormals
    x = x[np.abs(x) <= 448]  # ml_dtypes turns magnitudes >= 464 into NaN instead of saturating
    np.testing.assert_array_equal(encode_e4m3fn(x), _oracle_codes(x, ml_dtypes.float8_e4m3fn))


def test_e4m3fn_ties_go_to_even_mantissa():
    # 1 + 1/16 lies halfway between 1 (mantissa 000) and 1.125 (001); 1.1875 between 1.125 and 1.25 (010)
    # 2**-10 lies halfway between 0 and the smallest subnormal 2**-9; 3 * 2**-10 between 2**-9 and 2**-8
    x = np.float32([1 + 1 / 16, 1.1875, 2.0**-10, 3 * 2.0**-10])
    np.testing.assert_array_equal(decode_e4m3fn(encode_e4m3fn(x)), np.float32([1, 1.25, 0, 2.0**-8]))


def test_e4m3fn_saturates_and_encodes_specials():
    x = np.float32([448, 460, 464, 500, 1e30, np.inf, -464, -np.inf, np.nan, -np.nan, 0.0, -0.0])
    expected = [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0x7F, 0x7F, 0x00, 0x80]
    np.testing.assert_array_equal(encode_e4m3fn(x), np.uint8(expected))


def test_e4m3fn_encode_inverts_decode():
    codes = np.setdiff1d(np.arange(256), [0x7F, 0xFF]).astype(np.uint8)
    np.testing.assert_array_equal(encode_e4m3fn(decode_e4m3fn(codes)), codes)


def test_e4m3fnuz_decodes_all_256_codes_like_ml_dtypes():
    codes = np.arange(256, dtype=np.uint8)
    expected = codes.view(ml_dtypes.float8_e4m3fnuz).astype(np.float32)
    actual = decode_e4m3fnuz(codes)
    assert actual.dtype == np.float32
    np.testing.assert_array_equal(actual, expected)  # 0x80 is the only NaN, 0x7F is 240
    assert np.isnan(actual).sum() == 1 and actual[0x7F] == 240


@pytest.mark.parametrize("fp8_format", ["e4m3fn", "e4m3fnuz"])
def test_fp8_in_format_keeps_every_value(fp8_format):
    """fnuz keeps the e4m3fn bits and doubles the scale: every finite code decodes to the same
    value (-0 to +0), the NaNs stay NaN, and no code becomes fnuz's NaN 0x80 but a NaN."""
    codes = np.arange(256, dtype=np.uint8)
    scale = np.float32(2.0 ** -5)
    stored, stored_scale = fp8_in_format(codes, scale, fp8_format)
    want = decode_e4m3fn(codes) * scale
    got = decode_fp8(stored, fp8_format) * stored_scale
    np.testing.assert_array_equal(got, want)  # NaN where want is NaN
    assert stored_scale == (2 * scale if fp8_format == "e4m3fnuz" else scale)
    if fp8_format == "e4m3fnuz":
        assert stored[0x80] == 0x00 and set(np.flatnonzero(stored == 0x80)) == {0x7F, 0xFF}
    with pytest.raises(ValueError, match="fp8_format"):
        fp8_in_format(codes, scale, "e5m2")


def test_e2m1_decodes_all_16_codes_like_ml_dtypes():
    codes = np.arange(16, dtype=np.uint8)
    expected = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(decode_e2m1(codes), expected)
    np.testing.assert_array_equal(decode_e2m1(codes[:8]), np.float32([0, 0.5, 1, 1.5, 2, 3, 4, 6]))
    assert np.all(np.signbit(decode_e2m1(codes[8:])))


def test_e2m1_encode_matches_ml_dtypes_including_ties_and_saturation():
    grid = decode_e2m1(np.arange(8))
    x = np.concatenate([_grid_sweep(grid), RNG.uniform(-8, 8, 100_000).astype(np.float32),
                        np.float32([7, 100, np.inf, -np.inf])])
    np.testing.assert_array_equal(encode_e2m1(x), _oracle_codes(x, ml_dtypes.float4_e2m1fn))


def test_e2m1_ties_go_to_even_code():
    # 0.25: 0 (code 0) vs 0.5 (1); 0.75: 0.5 (1) vs 1 (2); 2.5: 2 (4) vs 3 (5); 5: 4 (6) vs 6 (7)
    x = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -5])
    np.testing.assert_array_equal(encode_e2m1(x), np.uint8([0, 2, 2, 4, 4, 6, 6, 14]))


def test_e8m0_matches_ml_dtypes():
    codes = np.arange(256, dtype=np.uint8)
    expected = codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    np.testing.assert_array_equal(decode_e8m0(codes), expected)
    powers = np.ldexp(np.float32(1), np.arange(-127, 128))
    np.testing.assert_array_equal(encode_e8m0(powers), _oracle_codes(powers, ml_dtypes.float8_e8m0fnu))
    np.testing.assert_array_equal(encode_e8m0(powers), codes[:255])
    assert encode_e8m0(np.float32(np.nan)) == 0xFF


@pytest.mark.parametrize("bad", [3.0, 0.0, -2.0, np.inf, 2.0**-128])
def test_e8m0_rejects_non_powers_of_two(bad):
    with pytest.raises(ValueError, match="powers of two"):
        encode_e8m0(np.float32([1.0, bad]))


def test_pack_fp4_puts_even_elements_in_the_low_nibble():
    codes = np.uint8([[0x1, 0x2, 0xF, 0x0, 0x7, 0x8]])
    packed = pack_fp4(codes)
    assert packed.dtype == np.int8
    np.testing.assert_array_equal(packed.view(np.uint8), np.uint8([[0x21, 0x0F, 0x87]]))
    np.testing.assert_array_equal(unpack_fp4(packed), codes)
    np.testing.assert_array_equal(unpack_fp4(packed.view(np.uint8)), codes)


def test_pack_fp4_validates_input():
    with pytest.raises(ValueError, match="even"):
        pack_fp4(np.uint8([1, 2, 3]))
    with pytest.raises(ValueError, match="0..15"):
        pack_fp4(np.uint8([1, 16]))


def test_pow2_ceil_scale_is_exact():
    qmax = 448.0
    exponents = np.arange(-40, 40)
    exact = np.ldexp(np.float32(qmax), exponents)
    np.testing.assert_array_equal(pow2_ceil_scale(exact, qmax), np.ldexp(np.float32(1), exponents))
    above = np.nextafter(exact, np.float32(np.inf))
    np.testing.assert_array_equal(pow2_ceil_scale(above, qmax), np.ldexp(np.float32(1), exponents + 1))
    ratio = np.exp2(RNG.uniform(-60, 60, 10_000)).astype(np.float32)
    scale = pow2_ceil_scale(ratio, 1.0)
    assert np.all((scale / 2 < ratio) & (ratio <= scale))
    assert np.all(np.frexp(scale)[0] == 0.5)
    assert pow2_ceil_scale(np.float32(0), 6) == 0 and np.isnan(pow2_ceil_scale(np.float32(np.nan), 6))


@pytest.mark.parametrize("scale_format", ["e8m0", "fp32"])
def test_fp8_blocks_error_bound(scale_format):
    w = (RNG.standard_normal((200, 300)) * np.exp2(RNG.integers(-8, 8, (200, 1)))).astype(np.float32)
    codes, scales = quantize_fp8_blocks(w, scale_format=scale_format)
    assert codes.shape == w.shape and codes.dtype == np.uint8
    assert scales.shape == (2, 3)
    assert scales.dtype == (np.uint8 if scale_format == "e8m0" else np.float32)
    restored = dequantize_fp8_blocks(codes, scales, scale_format=scale_format)
    scale = decode_e8m0(scales) if scale_format == "e8m0" else scales
    per_element_scale = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:200, :300]
    # half a unit in the last place: 2**-4 relative for normals, 2**-10 * scale for subnormals
    bound = np.maximum(np.abs(w) * 2.0**-4, per_element_scale * 2.0**-10)
    assert np.all(np.abs(restored - w) <= bound)


@pytest.mark.parametrize("scale_format", ["e8m0", "fp32"])
def test_fp8_blocks_recover_values_on_the_grid_exactly(scale_format):
    finite = np.setdiff1d(np.arange(256), [0x7F, 0xFF]).astype(np.uint8)
    codes = RNG.choice(finite, (130, 260))
    codes[::128, ::128] = 0x7E  # one 448 per block pins amax, so the scale is exactly 2**k
    block_scale = np.exp2(RNG.integers(-20, 10, (2, 3))).astype(np.float32)
    w = decode_e4m3fn(codes) * np.repeat(np.repeat(block_scale, 128, 0), 128, 1)[:130, :260]
    got_codes, scales = quantize_fp8_blocks(w, scale_format=scale_format)
    np.testing.assert_array_equal(decode_e4m3fn(got_codes), decode_e4m3fn(codes))
    np.testing.assert_array_equal(dequantize_fp8_blocks(got_codes, scales, scale_format=scale_format), w)


def test_fp8_blocks_all_zero_block_gets_the_floor_scale():
    codes, scales = quantize_fp8_blocks(np.zeros((4, 4), np.float32), block=2)
    np.testing.assert_array_equal(codes, 0)
    np.testing.assert_array_equal(decode_e8m0(scales), np.float32(2.0**-22))  # ceil-pow2 of 1e-4 / 448
    _, fp32_scales = quantize_fp8_blocks(np.zeros((4, 4), np.float32), block=2, scale_format="fp32")
    np.testing.assert_array_equal(fp32_scales, np.float32(1e-4) / np.float32(448))


def test_fp8_blocks_reject_bad_arguments():
    with pytest.raises(ValueError, match="scale_format"):
        quantize_fp8_blocks(np.zeros((2, 2), np.float32), scale_format="e4m3")
    with pytest.raises(ValueError, match="must have shape"):
        dequantize_fp8_blocks(np.zeros((200, 10), np.uint8), np.zeros((1, 1), np.uint8))


def test_fp4_groups_error_bound():
    w = (RNG.standard_normal((16, 128)) * np.exp2(RNG.integers(-10, 10, (16, 1)))).astype(np.float32)
    packed, scales = quantize_fp4_groups(w)
    assert packed.shape == (16, 64) and packed.dtype == np.int8
    assert scales.shape == (16, 4) and scales.dtype == np.uint8
    restored = dequantize_fp4_groups(packed, scales)
    per_element_scale = np.repeat(decode_e8m0(scales), 32, axis=1)
    # half the grid step is at most a quarter of the value (normals) or of the scale (0.5 region)
    assert np.all(np.abs(restored - w) <= 0.25 * np.maximum(np.abs(w), per_element_scale))


def test_fp4_groups_recover_values_on_the_grid_exactly():
    codes = RNG.integers(0, 16, (8, 96)).astype(np.uint8)
    codes[:, ::32] = 7  # one 6.0 per group pins amax, so the scale is exactly 2**k
    group_scale = np.exp2(RNG.integers(-30, 30, (8, 3))).astype(np.float32)
    w = decode_e2m1(codes) * np.repeat(group_scale, 32, axis=1)
    packed, scales = quantize_fp4_groups(w)
    np.testing.assert_array_equal(decode_e8m0(scales), group_scale)
    np.testing.assert_array_equal(dequantize_fp4_groups(packed, scales), w)


def test_fp4_groups_require_whole_groups():
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        quantize_fp4_groups(np.zeros((2, 48), np.float32))


def test_fp8_roundtrip_hand_computed():
    # amax 1000 -> 1000/448 = 2.23 -> s = 4; x/s = [0.25, -75, 0.025, 250]
    # e4m3: 0.25 exact; 75 has step 8 in [64, 128) -> 72; 0.025 has step 2**-9 -> 13 * 2**-9;
    # 250 has step 16 in [128, 256) -> 256. Times s = 4:
    x = np.float32([1, -300, 0.1, 1000])
    np.testing.assert_array_equal(fp8_roundtrip(x, block=4), np.float32([1, -288, 13 * 2.0**-7, 1024]))
    # amax 1e-5 is floored to 1e-4 -> s = 2**-22; 1e-5 / s = 41.94, step 4 in [32, 64) -> 40
    tiny = np.float32([1e-5, 0, 0, 0])
    np.testing.assert_array_equal(fp8_roundtrip(tiny, block=4), np.float32([40 * 2.0**-22, 0, 0, 0]))


def test_fp8_roundtrip_blocks_are_independent_and_shape_is_kept():
    x = np.float32([[1, -300, 0.1, 1000, 1e-5, 0, 0, 0]])
    np.testing.assert_array_equal(fp8_roundtrip(x, block=4),
                                  np.concatenate([fp8_roundtrip(x[:, :4], 4), fp8_roundtrip(x[:, 4:], 4)], -1))
    assert fp8_roundtrip(RNG.standard_normal((2, 3, 128)).astype(np.float32)).shape == (2, 3, 128)


def test_fp4_roundtrip_hand_computed():
    # amax 5 -> 5/6 -> s = 1; 0.3 -> 0.5; -1.3 -> -1.5; 2.5 ties to 2 (even code); 5 ties to 4
    x = np.float32([0.3, -1.3, 2.5, 5.0])
    np.testing.assert_array_equal(fp4_roundtrip(x, block=4), np.float32([0.5, -1.5, 2, 4]))
    # amax 12 -> 12/6 = 2 exactly -> s = 2 (no round-up); x/s = [6, 0.375, -3.5, 0.5]
    # -> [6, 0.5, -4 (tie 3|4 to even code), 0.5] -> times 2:
    x = np.float32([12, 0.75, -7, 1])
    np.testing.assert_array_equal(fp4_roundtrip(x, block=4), np.float32([12, 1, -8, 1]))


def test_roundtrips_keep_all_zero_blocks_zero_and_nan_visible():
    np.testing.assert_array_equal(fp4_roundtrip(np.zeros(32, np.float32)), 0)
    np.testing.assert_array_equal(fp8_roundtrip(np.zeros(64, np.float32)), 0)
    assert np.all(np.isnan(fp4_roundtrip(np.float32([np.nan] + [1] * 31))))


def _sylvester(d: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.kron(h, np.array([[1, 1], [1, -1]]))
    return h


@pytest.mark.parametrize("d", [1, 2, 4, 8, 64, 128])
def test_hadamard_equals_the_matrix_product(d):
    x = RNG.standard_normal((3, 5, d)).astype(np.float32)
    expected = x.astype(np.float64) @ _sylvester(d) / np.sqrt(d)
    actual = hadamard(x)
    assert actual.dtype == np.float32 and actual.shape == x.shape
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


def test_hadamard_is_orthogonal():
    d = 64
    h = _sylvester(d)
    np.testing.assert_array_equal(h @ h, d * np.eye(d))
    rotation = hadamard(np.eye(d, dtype=np.float32))
    np.testing.assert_allclose(rotation @ rotation.T, np.eye(d), atol=1e-6)
    x = RNG.standard_normal((4, d)).astype(np.float32)
    np.testing.assert_allclose(hadamard(hadamard(x)), x, atol=1e-5)  # symmetric and orthogonal


def test_hadamard_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(np.zeros((2, 6), np.float32))


@pytest.mark.parametrize("block", FP8_BLOCK_SIZES)
def test_fp8_blocks_of_every_size_round_trip(block):
    """V4's 128 x 128 blocks and V4.1's 32 x 32 (UE8M0 scales): a scale per block, values on the
    grid recovered exactly, and the artifact's format of that block size holds the same values
    whether it takes the checkpoint's codes or quantizes the float rows itself."""
    finite = np.setdiff1d(np.arange(256), [0x7F, 0xFF]).astype(np.uint8)
    shape = (3 * block + 5, 2 * block + 7)
    grid = (-(-shape[0] // block), -(-shape[1] // block))
    codes = RNG.choice(finite, shape)
    codes[::block, ::block] = 0x7E  # one 448 per block pins amax, so the scale is exactly 2**k
    block_scale = np.exp2(RNG.integers(-20, 10, grid)).astype(np.float32)
    w = decode_e4m3fn(codes) * np.repeat(np.repeat(block_scale, block, 0), block, 1)[:shape[0], :shape[1]]
    got_codes, scales = quantize_fp8_blocks(w, block, "e8m0")
    assert scales.shape == grid and scales.dtype == np.uint8
    np.testing.assert_array_equal(decode_e4m3fn(got_codes), decode_e4m3fn(codes))
    np.testing.assert_array_equal(dequantize_fp8_blocks(got_codes, scales, block, "e8m0"), w)

    fmt = WEIGHT_FORMATS[fp8_format_name(block)]
    assert fmt.group == block and fmt.stored(shape[1]) == {"": ("U8", shape[1]), ".scale": ("F32", grid[1])}
    row_scales = np.repeat(decode_e8m0(scales), block, axis=0)[:shape[0]]
    as_stored = fmt.lay_out("w", [Rows("FP8", got_codes, row_scales, block)])
    requantized = fmt.lay_out("w", [Rows("F32", w)])
    for arrays in (as_stored, requantized):
        np.testing.assert_array_equal(fmt.dequantize(arrays), w)
    np.testing.assert_array_equal(as_stored[""], requantized[""])
    # The other block size's format requantizes the checkpoint's codes to its own blocks.
    other = WEIGHT_FORMATS[fp8_format_name(next(b for b in FP8_BLOCK_SIZES if b != block))]
    requantized = other.lay_out("w", [Rows("FP8", got_codes, row_scales, block)])
    assert requantized[".scale"].shape[1] == -(-shape[1] // other.group)
