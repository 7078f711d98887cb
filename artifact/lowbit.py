"""Low-bit number formats of the DeepSeek-V4 checkpoint and its QAT activation rules.

Everything is plain numpy with its own bit manipulation, so the reference path needs
neither torch nor ml_dtypes (those serve only as test oracles):

* FP8 e4m3fn (OCP): bias 7, max 448, no infinities, 0x7F/0xFF are NaN.
* FP8 e4m3fnuz (gfx942): bias 8, max 240, no negative zero, 0x80 is the only NaN. It is only
  ever written as re-encoded e4m3fn (:func:`fp8_in_format`), never rounded onto directly.
* FP4 e2m1: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; codes 0..15 with the sign in bit 3.
* e8m0: a bare biased exponent (bias 127) used for power-of-two scales; 0xFF is NaN.

Encoders round to nearest, ties to even, and saturate out-of-range magnitudes to the
largest finite value, which is how the quantizers clamp ``x / scale``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

E4M3_MAX = 448.0
E2M1_MAX = 6.0

# amax floors of the reference ops (ir/reference_ops.py): they keep an all-zero block's scale finite
# and (for FP4) inside the e8m0 range, whose smallest normal power used is 2**-126.
FP8_AMAX_FLOOR = 1e-4
FP4_AMAX_FLOOR = E2M1_MAX * 2.0**-126

_E4M3_NAN = 0x7F
_E4M3FNUZ_NAN = 0x80
_E8M0_NAN = 0xFF
_E8M0_BIAS = 127


class _Minifloat(NamedTuple):
    """A small binary float: ``man_bits`` mantissa bits, smallest normal exponent
    ``emin``, largest finite magnitude ``max_value``, sign at bit ``sign_bit``."""

    man_bits: int
    emin: int
    max_value: float
    sign_bit: int


_E4M3 = _Minifloat(man_bits=3, emin=-6, max_value=E4M3_MAX, sign_bit=7)
_E4M3FNUZ = _Minifloat(man_bits=3, emin=-7, max_value=240.0, sign_bit=7)
_E2M1 = _Minifloat(man_bits=1, emin=0, max_value=E2M1_MAX, sign_bit=3)


def _encode_minifloat(x: np.ndarray, fmt: _Minifloat) -> np.ndarray:
    """Codes (int64) of float32 ``x`` rounded to nearest-even onto ``fmt``, saturating.

    NaN inputs get code +0; callers that have a NaN code substitute it.
    """
    magnitude = np.minimum(np.abs(x), np.float32(fmt.max_value))
    bits = np.where(np.isnan(x), np.float32(0), magnitude).view(np.uint32).astype(np.int64)
    exp_field = bits >> 23
    # float32 subnormals share the exponent of the smallest normal and lack the implicit one
    exponent = np.maximum(exp_field, 1) - 127
    mantissa = (bits & 0x7FFFFF) | np.where(exp_field > 0, 0x800000, 0)
    # The target grid spacing is 2**(max(exponent, emin) - man_bits); the float32
    # mantissa counts units of 2**(exponent - 23). Their ratio is the right shift.
    # Capping it at 25 keeps shifts defined: mantissa < 2**24 rounds to 0 from there on.
    shift = np.minimum(23 - fmt.man_bits + np.maximum(fmt.emin - exponent, 0), 25)
    steps = mantissa >> shift
    remainder = mantissa - (steps << shift)
    half = 1 << (shift - 1)
    steps += (remainder > half) | ((remainder == half) & (steps & 1 == 1))
    # steps already holds the implicit one (normals) or is the subnormal mantissa, so
    # this is exponent_field << man_bits | mantissa_field, carries included.
    code = ((np.maximum(exponent, fmt.emin) - fmt.emin) << fmt.man_bits) + steps
    sign = (x.view(np.uint32) >> 31).astype(np.int64)
    return code | (sign << fmt.sign_bit)


def _decode_minifloat(codes: np.ndarray, fmt: _Minifloat) -> np.ndarray:
    """float32 values of ``fmt`` codes (no NaN handling)."""
    codes = np.asarray(codes).astype(np.int32)
    magnitude = codes & ((1 << fmt.sign_bit) - 1)
    exp_field = magnitude >> fmt.man_bits
    mantissa = magnitude & ((1 << fmt.man_bits) - 1)
    significand = np.where(exp_field > 0, mantissa + (1 << fmt.man_bits), mantissa)
    value = np.ldexp(significand.astype(np.float32), np.maximum(exp_field, 1) + fmt.emin - 1 - fmt.man_bits)
    return np.where((codes >> fmt.sign_bit) & 1 == 1, -value, value)


def encode_e4m3fn(x) -> np.ndarray:
    """uint8 e4m3fn codes of float32 ``x``: nearest-even, |x| > 448 saturates, NaN -> 0x7F."""
    x = np.asarray(x, np.float32)
    return np.where(np.isnan(x), _E4M3_NAN, _encode_minifloat(x, _E4M3)).astype(np.uint8)


def decode_e4m3fn(codes) -> np.ndarray:
    """float32 values of uint8 e4m3fn codes (0x7F and 0xFF are NaN)."""
    codes = np.asarray(codes)
    return np.where(codes & 0x7F == _E4M3_NAN, np.float32(np.nan), _decode_minifloat(codes, _E4M3))


def encode_e2m1(x) -> np.ndarray:
    """uint8 e2m1 codes 0..15 of float32 ``x``: nearest, ties to the even code, |x| > 6 saturates.

    e2m1 has no NaN; NaN encodes as +0. The quantizers below still surface NaN input,
    because its block scale is NaN.
    """
    return _encode_minifloat(np.asarray(x, np.float32), _E2M1).astype(np.uint8)


def decode_e2m1(codes) -> np.ndarray:
    """float32 values of e2m1 codes 0..15."""
    return _decode_minifloat(codes, _E2M1)


def encode_e8m0(scale) -> np.ndarray:
    """uint8 e8m0 codes (biased exponent) of power-of-two float32 scales 2**-127..2**127.

    NaN encodes as 0xFF; anything else that is not such a power of two raises ValueError.
    """
    scale = np.asarray(scale, np.float32)
    mantissa, exponent = np.frexp(scale)  # a power of two is 0.5 * 2**exponent
    codes = exponent.astype(np.int32) - 1 + _E8M0_BIAS
    nan = np.isnan(scale)
    if not np.all(nan | ((mantissa == 0.5) & (codes >= 0))):
        raise ValueError("e8m0 scales must be powers of two in [2**-127, 2**127]")
    return np.where(nan, _E8M0_NAN, codes).astype(np.uint8)


def decode_e8m0(codes) -> np.ndarray:
    """float32 power-of-two scales of uint8 e8m0 codes (0xFF is NaN)."""
    codes = np.asarray(codes).astype(np.uint32)
    # A code is exactly a float32 exponent field; only 2**-127 (code 0) is a float32 subnormal.
    bits = np.where(codes == 0, 0x00400000, codes << 23)
    bits = np.where(codes == _E8M0_NAN, 0x7FC00000, bits)
    return bits.astype(np.uint32).view(np.float32)


def pack_fp4(codes) -> np.ndarray:
    """Pack e2m1 codes ``[..., 2n]`` into int8 ``[..., n]``: element 2i low nibble, 2i+1 high."""
    codes = np.asarray(codes, np.uint8)
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last axis, got shape {codes.shape}")
    if np.any(codes > 0xF):
        raise ValueError("pack_fp4 codes must lie in 0..15")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(np.int8)


def unpack_fp4(packed) -> np.ndarray:
    """Inverse of :func:`pack_fp4`: int8/uint8 ``[..., n]`` -> uint8 codes ``[..., 2n]``."""
    packed = np.asarray(packed)
    if packed.dtype not in (np.int8, np.uint8):
        raise ValueError(f"unpack_fp4 needs int8 or uint8 bytes, got {packed.dtype}")
    nibbles = packed.view(np.uint8)
    return np.stack([nibbles & 0xF, nibbles >> 4], axis=-1).reshape(*nibbles.shape[:-1], -1)


def pow2_ceil_scale(amax, qmax) -> np.ndarray:
    """``2**ceil(log2(amax / qmax))`` as float32, exact (frexp, not a rounded log2).

    The ratio is the float32 quotient, as in the reference ops. Zero, inf and NaN
    ratios pass through unchanged.
    """
    return pow2_ceil(np.asarray(amax, np.float32) / np.float32(qmax))


def pow2_ceil(ratio) -> np.ndarray:
    """``2**ceil(log2(ratio))`` of float32 ``ratio``, exact; zero, inf and NaN pass through."""
    ratio = np.asarray(ratio, np.float32)
    mantissa, exponent = np.frexp(ratio)  # ratio = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = exponent - (mantissa == 0.5)  # an exact power of two is not rounded up
    scale = np.ldexp(np.float32(1), exponent)
    return np.where(np.isfinite(ratio) & (ratio > 0), scale, ratio)


def _split_last_axis(x: np.ndarray, block: int) -> np.ndarray:
    """View ``x [..., n]`` as ``[..., n / block, block]``."""
    if x.shape[-1] % block:
        raise ValueError(f"last axis {x.shape[-1]} is not a multiple of the block size {block}")
    return x.reshape(*x.shape[:-1], -1, block)


def _pow2_block_scale(blocks: np.ndarray, amax_floor: float, qmax: float) -> np.ndarray:
    """Power-of-two scale per block (last axis, kept) mapping the block's amax onto qmax."""
    amax = np.maximum(np.abs(blocks).max(axis=-1, keepdims=True), np.float32(amax_floor))
    return pow2_ceil_scale(amax, qmax)


def _check_scale_format(scale_format: str) -> None:
    if scale_format not in ("e8m0", "fp32"):
        raise ValueError(f"scale_format must be 'e8m0' or 'fp32', got {scale_format!r}")


def _block_grid(shape: tuple[int, int], block: int) -> tuple[int, int]:
    return -(-shape[0] // block), -(-shape[1] // block)


def _expand_blocks(scale: np.ndarray, block: int, shape: tuple[int, int]) -> np.ndarray:
    """Per-element copy of a per-block scale grid, cropped to ``shape`` (edge blocks are partial)."""
    return np.repeat(np.repeat(scale, block, axis=0), block, axis=1)[: shape[0], : shape[1]]


def quantize_fp8_blocks(w, block: int = 128, scale_format: str = "e8m0") -> tuple[np.ndarray, np.ndarray]:
    """FP8 weight ``[O, I]`` -> (e4m3fn codes ``[O, I]``, one scale per ``block`` x ``block`` tile).

    Scales have shape ``[ceil(O/block), ceil(I/block)]``: e8m0 codes of
    ``pow2_ceil_scale(amax, 448)``, or float32 ``amax / 448``. amax is floored at
    FP8_AMAX_FLOOR (1e-4) in both formats, so an all-zero tile gets a finite scale.
    """
    _check_scale_format(scale_format)
    w = np.asarray(w, np.float32)
    row_starts, col_starts = np.arange(0, w.shape[0], block), np.arange(0, w.shape[1], block)
    amax = np.maximum.reduceat(np.maximum.reduceat(np.abs(w), row_starts, axis=0), col_starts, axis=1)
    amax = np.maximum(amax, np.float32(FP8_AMAX_FLOOR))
    if scale_format == "e8m0":
        scale = pow2_ceil_scale(amax, E4M3_MAX)
        stored = encode_e8m0(scale)
    else:
        scale = stored = amax / np.float32(E4M3_MAX)
    return encode_e4m3fn(w / _expand_blocks(scale, block, w.shape)), stored


def quantize_fp8_row_groups(w, group: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """FP8 rows ``[O, I]`` -> (e4m3fn codes ``[O, I]``, e8m0 scales ``[O, I / group]``): one scale
    per ``group`` columns of each row, as V4.1's Engram tables are stored (the weight rule of
    :func:`quantize_fp8_blocks` on 1 x ``group`` blocks)."""
    w = np.asarray(w, np.float32)
    groups = _split_last_axis(w, group)
    scale = _pow2_block_scale(groups, FP8_AMAX_FLOOR, E4M3_MAX)
    return encode_e4m3fn(groups / scale).reshape(w.shape), encode_e8m0(scale[..., 0])


def dequantize_fp8_blocks(codes, scales, block: int = 128, scale_format: str = "e8m0") -> np.ndarray:
    """float32 ``[O, I]`` weight of :func:`quantize_fp8_blocks` output."""
    _check_scale_format(scale_format)
    codes, scales = np.asarray(codes), np.asarray(scales)
    if scales.shape != _block_grid(codes.shape, block):
        raise ValueError(f"{block}x{block} block scales of a {codes.shape} weight must have shape "
                         f"{_block_grid(codes.shape, block)}, got {scales.shape}")
    scale = decode_e8m0(scales) if scale_format == "e8m0" else scales.astype(np.float32)
    return decode_e4m3fn(codes) * _expand_blocks(scale, block, codes.shape)


def quantize_fp4_groups(w, group: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """FP4 weight ``[O, I]`` -> (packed int8 ``[O, I/2]``, e8m0 scales ``[O, I/group]``).

    Per group of ``group`` inputs: scale = pow2_ceil_scale(max(amax, 6 * 2**-126), 6),
    codes = e2m1(clamp(w / scale, -6, 6)).
    """
    w = np.asarray(w, np.float32)
    groups = _split_last_axis(w, group)
    scale = _pow2_block_scale(groups, FP4_AMAX_FLOOR, E2M1_MAX)
    codes = encode_e2m1(groups / scale)  # saturation is the clamp to +-6
    return pack_fp4(codes.reshape(w.shape)), encode_e8m0(scale[..., 0])


def dequantize_fp4_groups(packed, scales, group: int = 32) -> np.ndarray:
    """float32 ``[O, I]`` weight of :func:`quantize_fp4_groups` output."""
    values = decode_e2m1(unpack_fp4(packed))
    groups = _split_last_axis(values, group)
    scales = np.asarray(scales)
    if scales.shape != groups.shape[:-1]:
        raise ValueError(f"group-{group} scales of a {values.shape} weight must have shape "
                         f"{groups.shape[:-1]}, got {scales.shape}")
    return (groups * decode_e8m0(scales)[..., None]).reshape(values.shape)


def fp8_roundtrip(x, block: int = 64) -> np.ndarray:
    """QAT FP8 activation round trip over blocks of the last axis.

    s = pow2_ceil_scale(max(amax, 1e-4), 448); y = e4m3(clamp(x / s, +-448)) * s.
    """
    blocks = _split_last_axis(np.asarray(x, np.float32), block)
    scale = _pow2_block_scale(blocks, FP8_AMAX_FLOOR, E4M3_MAX)
    return (decode_e4m3fn(encode_e4m3fn(blocks / scale)) * scale).reshape(np.shape(x))


def fp4_roundtrip(x, block: int = 32) -> np.ndarray:
    """QAT FP4 activation round trip over blocks of the last axis.

    s = pow2_ceil_scale(max(amax, 6 * 2**-126), 6); y = e2m1(clamp(x / s, +-6)) * s.
    """
    blocks = _split_last_axis(np.asarray(x, np.float32), block)
    scale = _pow2_block_scale(blocks, FP4_AMAX_FLOOR, E2M1_MAX)
    return (decode_e2m1(encode_e2m1(blocks / scale)) * scale).reshape(np.shape(x))


# DeepSeek-V4.1's activation round trips (docs/v41.md, "Fake-quant"): the reference scales by the
# product with the float32 reciprocal of the format's maximum (not a quotient), and passes a vector
# whose length is not a multiple of the block through unchanged.
V41_ROUNDTRIPS = ("fp8_b32", "fp4_b32", "fp4_e4m3_b16")


def v41_roundtrip(x, fmt: str) -> np.ndarray:
    """``fp8_b32``: window KV, e4m3 in blocks of 32 with power-of-two scales; ``fp4_b32``: index
    queries and keys, e2m1 in blocks of 32 with power-of-two scales; ``fp4_e4m3_b16``: compressed
    rows, e2m1 in blocks of 16 with e4m3 scales."""
    x = np.asarray(x, np.float32)
    block = 16 if fmt == "fp4_e4m3_b16" else 32
    if x.shape[-1] % block:
        return x
    blocks = _split_last_axis(x, block)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    if fmt == "fp8_b32":
        scale = pow2_ceil(np.maximum(amax, np.float32(FP8_AMAX_FLOOR)) * np.float32(1 / E4M3_MAX))
        return (decode_e4m3fn(encode_e4m3fn(blocks / scale)) * scale).reshape(x.shape)
    if fmt == "fp4_b32":
        scale = pow2_ceil(np.maximum(amax, np.float32(FP4_AMAX_FLOOR)) * np.float32(1 / E2M1_MAX))
    elif fmt == "fp4_e4m3_b16":
        scale = decode_e4m3fn(encode_e4m3fn(np.maximum(amax, np.float32(E2M1_MAX * 2.0**-9)) / np.float32(E2M1_MAX)))
    else:
        raise ValueError(f"unknown V4.1 round trip {fmt!r}; expected one of {', '.join(V41_ROUNDTRIPS)}")
    return (decode_e2m1(encode_e2m1(blocks / scale)) * scale).reshape(x.shape)


def hadamard(x) -> np.ndarray:
    """Normalised Walsh-Hadamard rotation of the last axis: ``x @ H / sqrt(d)``.

    H is Sylvester's (Kronecker powers of [[1, 1], [1, -1]]), d a power of two. Computed
    by the O(d log d) butterfly: stage h combines elements h apart within blocks of 2h.
    """
    x = np.asarray(x, np.float32)
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"hadamard needs a power-of-two last axis, got {d}")
    rows = x.reshape(-1, d)
    h = 1
    while h < d:
        pairs = rows.reshape(rows.shape[0], d // (2 * h), 2, h)
        low, high = pairs[:, :, 0], pairs[:, :, 1]
        rows = np.stack([low + high, low - high], axis=2)
        h *= 2
    return rows.reshape(x.shape) * np.float32(d**-0.5)


def bf16_bits_from_f32(x) -> np.ndarray:
    """uint16 bfloat16 bits of float32 ``x``, rounded to nearest even; NaN stays (quiet) NaN."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit rounds to nearest, ties to even, before truncating.
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    # Rounding could carry a NaN payload into inf or wrap it; set the quiet bit instead.
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return np.where(is_nan, (bits >> 16) | 0x0040, rounded).astype(np.uint16)


def f32_from_bf16_bits(bits) -> np.ndarray:
    """float32 values of uint16 bfloat16 bits (exact: bf16 is the top half of a float32)."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def bf16_roundtrip(x) -> np.ndarray:
    """float32 values rounded to bfloat16 (nearest even) and back."""
    return f32_from_bf16_bits(bf16_bits_from_f32(x))


def e4m3fn_to_fnuz(codes) -> np.ndarray:
    """Re-encode OCP e4m3fn bytes as e4m3fnuz for gfx942: the same bits are worth half there
    (bias 8), so callers keep the bits and double the block scale. -0 (0x80) is NaN in fnuz
    and becomes +0; the fn NaNs (0x7F, 0xFF) become the fnuz NaN 0x80."""
    codes = np.asarray(codes, np.uint8)
    out = np.where(codes == 0x80, np.uint8(0), codes)
    return np.where((codes & 0x7F) == 0x7F, np.uint8(_E4M3FNUZ_NAN), out).astype(np.uint8)


def decode_e4m3fnuz(codes) -> np.ndarray:
    """float32 values of uint8 e4m3fnuz codes (0x80 is NaN; 0x7F / 0xFF are +-240)."""
    codes = np.asarray(codes)
    return np.where(codes == _E4M3FNUZ_NAN, np.float32(np.nan), _decode_minifloat(codes, _E4M3FNUZ))


# What an e4m3fn code's scale is multiplied by when its bits are stored in each FP8 format.
FP8_SCALE_FACTOR = {"e4m3fn": 1.0, "e4m3fnuz": 2.0}
FP8_FORMATS = tuple(FP8_SCALE_FACTOR)
FP8_EXPONENT_BIAS = {"e4m3fn": 1 - _E4M3.emin, "e4m3fnuz": 1 - _E4M3FNUZ.emin}  # 7, 8


def _check_fp8_format(fp8_format: str) -> None:
    if fp8_format not in FP8_FORMATS:
        raise ValueError(f"fp8_format must be one of {FP8_FORMATS}, got {fp8_format!r}")


def fp8_in_format(codes, scale, fp8_format: str) -> tuple[np.ndarray, np.ndarray]:
    """e4m3fn codes and their scale (float32, any shape) as the same values in ``fp8_format``:
    unchanged for e4m3fn; for e4m3fnuz the bits are kept (:func:`e4m3fn_to_fnuz`) and the scale
    doubled, exactly (the scales in use are far from the float32 range ends)."""
    _check_fp8_format(fp8_format)
    scale = (np.asarray(scale, np.float32) * np.float32(FP8_SCALE_FACTOR[fp8_format])).astype(np.float32)
    codes = np.asarray(codes, np.uint8)
    return (codes if fp8_format == "e4m3fn" else e4m3fn_to_fnuz(codes)), scale


def decode_fp8(codes, fp8_format: str) -> np.ndarray:
    """float32 values of uint8 codes in ``fp8_format`` (unscaled)."""
    _check_fp8_format(fp8_format)
    return decode_e4m3fn(codes) if fp8_format == "e4m3fn" else decode_e4m3fnuz(codes)
